"""The native extensions (everything else is in pyproject.toml): `ucm._hostcopy`, a copy that
takes the block's xxh3 on the way (native/hostcopy*.c), and `ucm._kvcodec`, the int8/int4 KV
decoding loop (native/kvcodec*.c). Optional: without a C compiler or xxhash.h (Debian
libxxhash-dev) ucm installs and runs, verifying with xxh3 then memmove, decoding with numpy."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("ucm._hostcopy", ["native/hostcopy.c", "native/hostcopy_avx2.c"],
                             depends=["native/hostcopy_impl.h"], optional=True,
                             extra_compile_args=["-O3"]),
                   # the int8/int4 KV decoding loop (native/kvcodec*.c); numpy without it
                   Extension("ucm._kvcodec", ["native/kvcodec.c", "native/kvcodec_avx2.c"],
                             depends=["native/kvcodec_impl.h"], optional=True,
                             # no fused multiply-add: bit for bit the numpy reference
                             extra_compile_args=["-O3", "-ffp-contract=off"])])
