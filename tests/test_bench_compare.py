"""`specserve bench compare` runs every case on a tiny model and reports consistent ratios."""

from __future__ import annotations

import json

from specserve.cli import main


def test_compare_runs_engine_cases_and_hf_and_plots(tmp_path, capsys):
    out_json, png = tmp_path / "rows.json", tmp_path / "plot.png"
    rc = main(
        [
            "bench", "compare", "--model-path", "tiny", "--device", "cpu", "--batch-size", "2",
            "--input-len", "8", "--output-len", "10", "--accept-lengths", "1", "3",
            "--draft-vocab-size", "200", "--output-json", str(out_json), "--plot", str(png),
        ]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out_json.read_text())
    kinds = [(r["engine"], r["overlap"], r["accept_length_target"]) for r in rows]
    assert ("specserve", True, None) in kinds and ("specserve", False, None) in kinds
    for acc in (1.0, 3.0):
        assert ("specserve-eagle3", True, acc) in kinds and (
            "specserve-eagle3",
            False,
            acc,
        ) in kinds
    assert any(e == "hf-transformers-static" for e, _, _ in kinds)
    for r in rows:
        assert r["decode_tok_s"] > 0
        if r["accept_length_target"] == 3.0:
            assert abs(r["accept_length"] - 3.0) < 0.4  # forced; the prefill token counts too
    assert rows[0]["vs_specserve_plain"] == 1.0
    assert png.stat().st_size > 1000
    assert "decode_tok_s" in capsys.readouterr().out
