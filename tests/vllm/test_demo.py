"""`ucm demo`: its chat workload (chat template, real documents, answers carried into later
turns), the split of a request's time to first token over engine steps, and one tiny run of
both rounds on the random model, counting what the warm round loaded."""

from __future__ import annotations

import pytest

demo = pytest.importorskip("ucm.bench.demo")
pytest.importorskip("transformers")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The random model's tokenizer with a ChatML template (SmolLM2's layout)."""
    from transformers import AutoTokenizer

    from ucm.bench.models import ModelSpec, build_model

    path = build_model(tmp_path_factory.mktemp("demo-tok"), ModelSpec(vocab=2048))
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def test_the_workload_is_chat_template_prompts_over_real_documents(tokenizer):
    from ucm.bench.texts import documents

    docs = demo.pick_documents(tokenizer, 2, 200)
    assert len({text for _, text in docs}) == 2
    real = dict(documents(min_chars=800))
    for label, text in docs:
        assert text and text in real[label]  # a cut of an installed package's text
        assert len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= 200
    convs = demo.conversations(docs, sessions=4, turns=3)
    assert [c.doc for c in convs] == [0, 1, 0, 1]
    for t in range(3):  # sessions on one document ask different questions at each turn
        assert convs[0].questions[t] != convs[2].questions[t]
    start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    for c in convs:
        c.answers += [f"answer {i} of session {c.doc}" for i in range(2)]
    prompts = [[demo.chat_prompt(tokenizer, c.messages(t)) for c in convs] for t in range(3)]
    for t, batch in enumerate(prompts):
        for c, ids in zip(convs, batch, strict=True):
            # system, then per turn a user message, the earlier turns' answers, then the
            # generation prompt
            assert ids.count(start) == 1 + (t + 1) + t + 1
            assert ids.count(end) == 1 + (t + 1) + t
            text = tokenizer.decode(ids, skip_special_tokens=True)
            assert docs[c.doc][1] in text
            assert all(a in text for a in c.answers[:t])
            if t:  # each turn extends the previous one's prompt (a shared prefix to reuse)
                before = prompts[t - 1][convs.index(c)]
                assert ids[:len(before) - 3] == before[:-3]
    # sessions on one document share the system prompt and the document
    shared = sum(1 for a, b in zip(prompts[0][0], prompts[0][2], strict=False) if a == b)
    assert shared >= len(tokenizer(docs[0][1], add_special_tokens=False)["input_ids"]) - 2


def test_ttft_parts_split_a_requests_steps_into_queued_load_and_compute():
    steps = [  # request 0 prefills in steps 1-2, request 1 waits for them, then step 3
        {"t0": 0.0, "t1": 1.0, "tokens": {"0": 100}, "load_wait_ns": 200_000_000},
        {"t0": 1.0, "t1": 1.5, "tokens": {"0": 20}, "load_wait_ns": 0},
        {"t0": 1.5, "t1": 1.75, "tokens": {"0": 1, "1": 50}, "load_wait_ns": 50_000_000},
    ]
    parts = demo.ttft_parts({"steps": steps, "ttft_s": [1.5, 1.75]})
    assert parts[0]["steps"] == 2 and parts[1]["steps"] == 3
    assert parts[0]["queued"] == 0 and parts[1]["queued"] == pytest.approx(1.5)
    assert parts[0]["load"] == pytest.approx(0.2) and parts[1]["load"] == pytest.approx(0.05)
    assert parts[0]["compute"] == pytest.approx(1.3) and parts[1]["compute"] == pytest.approx(0.2)
    assert parts[0]["lookup"] == parts[0]["ucm"] == parts[1]["lookup"] == parts[1]["ucm"] == 0


def test_ttft_parts_name_ucms_lookup_steps_and_its_time_inside_a_step():
    steps = [  # request 1's lookup is not in at step 1 (ucm: "ask again later")
        {"t0": 0.0, "t1": 0.1, "tokens": {"0": 2}, "load_wait_ns": 10_000_000,
         "save_ns": 4_000_000, "schedule_ns": 1_000_000, "lookup_deferred": 1},
        {"t0": 0.1, "t1": 0.3, "tokens": {"0": 1, "1": 2}, "load_wait_ns": 20_000_000,
         "save_ns": 0, "schedule_ns": 2_000_000, "lookup_deferred": 0},
    ]
    parts = demo.ttft_parts({"steps": steps, "ttft_s": [0.1, 0.3]})
    first, second = parts
    assert first["steps"] == 1 and second["steps"] == 2
    assert first["lookup"] == 0 and second["lookup"] == pytest.approx(0.1)
    assert second["queued"] == 0
    assert first["ucm"] == pytest.approx(0.005) and second["ucm"] == pytest.approx(0.002)
    assert first["compute"] == pytest.approx(0.085) and second["compute"] == pytest.approx(0.178)
    for p in parts:  # every part of the TTFT is named once
        assert p["queued"] + p["lookup"] + p["load"] + p["ucm"] + p["compute"] == \
            pytest.approx(p["ttft"])


@pytest.mark.slow
def test_a_tiny_demo_run_loads_the_warm_rounds_prompts(tmp_path, monkeypatch):
    """Two sessions over two documents of ~300 tokens, two turns, the random model: the cold
    round computes turn 1 and loads nothing; the warm round loads >= 90 % of turn 1's prompt
    tokens from ucm, replays the same prompts, and vLLM's own hits compute what it did."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the store and traces
    args = demo.build_parser().parse_args(
        ["--model", "random", "--sessions", "2", "--turns", "2", "--docs", "2",
         "--doc-tokens", "300", "--answer-tokens", "4", "--workdir", str(tmp_path)])
    out = demo.run(args)
    from ucm.bench.engines import native_dtype

    assert out["dtype"] == native_dtype()[0]  # no --dtype: the CPU's own
    cold, warm, floor = out["cold"], out["warm"], out["floor"]
    assert [r["name"] for r in cold] == [r["name"] for r in warm] == ["1", "2"]
    assert [r["prompt"] for r in cold] == [r["prompt"] for r in warm] == \
        [r["prompt"] for r in floor]
    assert cold[0]["loaded"] == 0 and cold[0]["computed"] >= 0.9 * cold[0]["prompt"]
    # every whole block of turn 1 (vLLM computes the rest, at least the last token) is a hit,
    # loaded from ucm unless an earlier request of the batch brought it
    whole = sum((n - 1) // BLOCK_TOKENS * BLOCK_TOKENS for n in warm[0]["lengths"])
    assert warm[0]["loaded"] + warm[0]["local"] == whole
    assert warm[0]["loaded"] >= 0.9 * whole
    assert warm[0]["computed"] == floor[0]["computed"] < BLOCK_TOKENS * 2
    assert floor[0]["loaded"] == 0
    for rows in (cold, warm, floor):  # every request's TTFT falls into the three parts
        for r in rows:
            assert len(r["parts"]) == r["requests"] == 2
            assert all(p["steps"] >= 1 for p in r["parts"])
    assert all(len(c.answers) == 2 for c in out["conversations"])
    # the worker's total also counts the warm-up batch, which the cold engine stored too
    assert out["warm_stats"]["worker"]["loaded_blocks"] * BLOCK_TOKENS > \
        sum(r["loaded"] for r in warm)


BLOCK_TOKENS = 32
