"""Source patches that let SGLang 0.5.19 run HiCache on a CPU-only torch (test venv only).

Each patch replaces one exact snippet once and leaves a marker, so running this again is a
no-op; a snippet that is neither there nor patched stops the setup with the file named.
usage: .venv-sglang/bin/python scripts/sglang/patch_sglang.py
"""

from __future__ import annotations

import importlib.util
import os
import sys

CPU_ALLOC = '''def _ucm_alloc_plain_cpu(dims, dtype, device, pin_memory, allocator,
                         registration_granularity_bytes=None):  # UCM-PATCH host-pool
    return allocator.allocate(dims, dtype=dtype, device=device)


ALLOC_MEMORY_FUNCS = defaultdict(
    lambda: alloc_with_host_register,
    {
        "cpu": _ucm_alloc_plain_cpu,
'''

EXTEND = '''        if str(self.device) == "cpu":  # UCM-PATCH alloc-extend
            alloc_extend_naive(prefix_lens, seq_lens, last_loc, self.free_pages,
                               out_indices, self.page_size, self.device)
        else:
          alloc_extend_kernel[(bs,)](
'''

DECODE = '''        if str(self.device) == "cpu":  # UCM-PATCH alloc-decode
            ps = self.page_size
            sl = seq_lens.to(torch.int64)
            opens_page = (sl - 1) % ps == 0
            rank = torch.cumsum(opens_page.to(torch.int64), 0) - 1
            fresh = self.free_pages[rank.clamp(min=0)].to(torch.int64) * ps if bs else out_indices
            out_indices.copy_(torch.where(opens_page, fresh, last_loc.to(torch.int64) + 1))
        else:
          alloc_decode_kernel[(bs,)](
'''

TORCHVISION = '''if extension._has_ops():  # UCM-PATCH torchvision
    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401
from torchvision import (
    datasets,'''


def package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.origin is not None, name
    return os.path.dirname(spec.origin)


def patch(path: str, old: str, new: str, marker: str) -> None:
    with open(path) as f:
        text = f.read()
    if marker in text:
        return
    if old not in text:
        sys.exit(f"patch_sglang: {marker}: the expected source is not in {path}")
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))
    print(f"patch_sglang: {marker} applied")


def main() -> None:
    # torchvision's wheel is CUDA-built: without its extension its op registrations raise.
    tv = os.path.join(package_dir("torchvision"), "__init__.py")
    patch(tv, "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
          "    datasets,", TORCHVISION, "UCM-PATCH torchvision")
    sg = package_dir("sglang")
    pool = os.path.join(sg, "srt/mem_cache/pool_host")
    # The host KV pool registers its memory with CUDA; on the CPU a plain allocation does.
    patch(os.path.join(pool, "common.py"),
          "ALLOC_MEMORY_FUNCS = defaultdict(\n    lambda: alloc_with_host_register,\n    {\n",
          CPU_ALLOC, "UCM-PATCH host-pool")
    # The paged allocator's Triton kernels have no CPU driver: torch versions instead.
    paged = os.path.join(sg, "srt/mem_cache/allocator/paged.py")
    patch(paged, "        alloc_extend_kernel[(bs,)](\n", EXTEND, "UCM-PATCH alloc-extend")
    patch(paged, "        alloc_decode_kernel[(bs,)](\n", DECODE, "UCM-PATCH alloc-decode")
    # The host pool's transfers come from sgl_kernel.kvcacheio (the stand-in on the CPU).
    patch(os.path.join(pool, "mha.py"),
          "if _is_cuda or _is_hip:\n    from sgl_kernel.kvcacheio import (",
          "if _is_cuda or _is_hip or _ucm_is_cpu():  # UCM-PATCH kvcacheio\n"
          "    from sgl_kernel.kvcacheio import (", "UCM-PATCH kvcacheio")
    patch(os.path.join(pool, "mha.py"), "\nif _is_cuda or _is_hip or _ucm_is_cpu():",
          "\nfrom sglang.srt.utils import is_cpu as _ucm_is_cpu  # UCM-PATCH is-cpu\n\n"
          "if _is_cuda or _is_hip or _ucm_is_cpu():", "UCM-PATCH is-cpu")
    # Pinned memory needs an accelerator; without one the prefetch thread dies on it.
    for name in ("base.py", "mha.py"):
        patch(os.path.join(pool, name), "        self.pin_memory = pin_memory\n",
              "        self.pin_memory = pin_memory and torch.cuda.is_available()"
              "  # UCM-PATCH no-pin\n", "UCM-PATCH no-pin")


if __name__ == "__main__":
    main()
