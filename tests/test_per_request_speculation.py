"""The per-request switch `speculative`: a request with it false is decoded plainly inside a
speculative batch (no draft token is ever accepted for it), and nobody's output changes."""

from __future__ import annotations

import pytest

from specserve import Engine
from specserve.errors import InvalidArgument
from specserve.runtime.cuda_graphs import DecodeGraphs
from tests.engine_utils import TINY, mixed_prompts, spec_args


def run(prompts, params, padded: bool = False, **kw):
    with Engine(**TINY, debug_check_invariants=True, **kw) as e:
        if padded:  # the CUDA-graph shape (padded batch, static inputs), eagerly on CPU
            e.core.worker.graphs = DecodeGraphs(e.core.worker, 4, max_width=4096, capture=False)
        return e.generate(input_ids=prompts, sampling_params=params)


@pytest.mark.parametrize("page_size", [1, 3])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("topk,ndt", [(1, 4), (3, 8)])
def test_mixed_switches_decode_as_plain_decoding(page_size, overlap, padded, topk, ndt):
    prompts = mixed_prompts(6, 512, seed=page_size + topk)
    params = [
        {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True, "speculative": i % 2 == 0}
        for i in range(6)
    ]
    kw = dict(page_size=page_size, disable_overlap_schedule=not overlap)
    plain = run(prompts, params, **kw)
    # the target as its own draft: every draft would be accepted if allowed
    spec = run(prompts, params, padded=padded, **kw, **spec_args("tiny", topk, 3, ndt))
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]
    for i, o in enumerate(spec):
        meta = o["meta_info"]
        if params[i]["speculative"]:
            assert meta["spec_accept_length"] > 2.5
        else:
            assert meta["spec_accept_length"] == 1.0
            assert meta["spec_accept_histogram"] == [meta["spec_verify_ct"]]


def test_sampled_requests_switched_off_keep_their_seeded_output():
    prompts = mixed_prompts(4, 512, seed=9)
    params = [
        {"temperature": 0.8, "top_p": 0.9, "seed": 7 + i, "max_new_tokens": 10,
         "ignore_eos": True, "speculative": bool(i % 2)}
        for i in range(4)
    ]  # fmt: skip
    plain = run(prompts, params)
    spec = run(prompts, params, **spec_args("tiny", 2, 3, 6))
    assert [o["output_ids"] for o in spec] == [o["output_ids"] for o in plain]


def test_the_switch_is_a_boolean():
    from specserve.sampling_params import SamplingParams

    for bad in ("no", 0, None):
        with pytest.raises(InvalidArgument) as e:
            SamplingParams.from_any({"speculative": bad})
        assert e.value.field == "speculative"


def test_the_switch_on_every_route():
    from fastapi.testclient import TestClient

    from specserve.server.app import create_app
    from specserve.server.server_config import ServerConfig

    engine = Engine(**TINY, **spec_args("tiny", 2, 3, 6))
    with TestClient(create_app(engine, ServerConfig())) as client:
        ids = list(range(5, 30))
        sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True, "speculative": False}
        out = client.post("/generate", json={"input_ids": ids, "sampling_params": sp}).json()
        assert out["meta_info"]["spec_accept_length"] == 1.0
        body = {"model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        for flag, want_plain in ((False, True), (True, False)):
            usage = client.post("/v1/completions", json={**body, "speculative": flag}).json()
            assert (usage["usage"]["spec_accept_length"] == 1.0) == want_plain
        bad = client.post("/v1/completions", json={**body, "speculative": "no"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"
