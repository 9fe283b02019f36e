"""`ucm proxy`: an OpenAI-compatible front for prefill/decode disaggregation through ucm, or
a router over instances that each do both.

    ucm proxy --prefill URL[,URL...] --decode URL[,URL...] [--host 127.0.0.1] [--port 8000]
              [--route roundrobin|prefix] [--kv-events ENDPOINT[,ENDPOINT...]]
              [--prefill-timeout 600]
    ucm proxy --instances URL[,URL...] [--route roundrobin|prefix]
              [--kv-events ENDPOINT[,ENDPOINT...]] [--host 127.0.0.1] [--port 8000]

Each POST to /v1/completions or /v1/chat/completions goes first to a prefill instance (`ucm
serve --kv-role producer`) with `max_tokens` 1 and streaming off: it computes the prompt's KV
and stores its full blocks in ucm. The original request then goes to a decode instance (`ucm
serve --kv-role consumer`), which loads those blocks from ucm (waiting up to its
`consumer_wait` for blocks still being written) and generates; its answer is the client's,
streamed chunk by chunk when the request streams. Instances are taken in turn (round robin);
with `--route prefix` the proxy subscribes to each prefill instance's vLLM KV events (ZMQ,
msgpack; ucm's connector publishes its stored blocks there), keeps an index of which instance
holds which chain of token blocks in which media (`PrefixIndex`, keyed by token content), and
sends the prefill to the instance whose fastest tier holds the longest prefix of the prompt,
tokenized by an instance's /tokenize.

Errors: a prefill or decode instance's error answer (a status of 400 or more) is passed to the
client with its status and body. A prefill instance that cannot be reached, or has not answered
within `--prefill-timeout` seconds (a hung instance), is skipped for the next one; when none
answers the request goes to the decode instance alone, which recomputes the prompt (after its
bounded wait, counted in its metrics): an answer rather than an outage, marked in the
`x-ucm-prefill: unavailable` response header. A decode instance that
cannot be reached is skipped for the next one; when none can be reached the answer is 502 with
an error naming them. GET /v1/models is a decode instance's, GET /health the proxy's own.

With `--instances` (instances that prefill and decode, `ucm serve` with the default kv role)
each request goes whole to one instance, picked as a prefill instance is (in turn, or by the
longest prefix in the fastest tier with `--route prefix`); an unreachable one is skipped for
the next, and the `x-ucm-instance` response header names the one that answered.

Built on Starlette (routing, streaming responses), uvicorn (the server) and httpx (the async
client with streamed bodies): vLLM's OpenAI server runs on the same three, so they are
installed wherever `ucm serve` runs; elsewhere the `proxy` extra installs them.
"""

from ucm.proxy.front import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    ROUTES,
    Proxy,
    RoundRobin,
    main,
    parse_urls,
    prefill_body,
)

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "ROUTES", "Proxy", "RoundRobin", "main",
           "parse_urls", "prefill_body"]
