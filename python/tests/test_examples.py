"""python/examples/compare_selectors.py on a small setting: its recalls are shares in [0, 1], and
the oracle (the exact top pages of the measure itself) is never below a page selector that
attends as many pages. Needs torch, transformers 5, gguf and accelerate (see test_transformers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

for _name in ("torch", "transformers", "gguf", "accelerate"):
    pytest.importorskip(_name, reason=f"{_name} is not installed (the example needs torch, "
                        "transformers, gguf and accelerate: scripts/gpu_python_check.sh)")

from test_model import DEVIL, ROOT  # noqa: E402

EXAMPLE = os.path.join(ROOT, "python", "examples", "compare_selectors.py")


def test_compare_selectors_reports_sane_recalls(model_path, tmp_path):
    if not os.path.exists(DEVIL):
        pytest.skip(f"no {DEVIL} (the demo's document)")
    out = tmp_path / "recall.json"
    run = subprocess.run([sys.executable, EXAMPLE, "--model", model_path, "--prompt-tokens", "1500",
                          "--steps", "2", "--layers", "0,9,29", "--json", str(out)],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr
    print(run.stdout)
    got = json.loads(out.read_text())
    results = {(r["selector"], r["budget"]): r for r in got["results"]}
    assert got["prompt_tokens"] == 1500 and len(results) == 6 * 3
    for r in results.values():
        assert 0.0 <= r["min_recall"] <= r["recall"] <= 1.0 + 1e-9, r
        assert 0.0 < r["attended"] <= 1.0, r
    for budget in (0.02, 0.05, 0.10):
        oracle = results[("oracle", budget)]
        for sel in ("quest", "locks"):  # the same pages allowed: floor(budget tokens / 16)
            other = results[(sel, budget)]
            assert other["attended"] == pytest.approx(oracle["attended"], abs=1e-9)
            assert oracle["recall"] >= other["recall"] - 1e-6, (budget, sel)
            assert oracle["min_recall"] >= other["min_recall"] - 1e-6, (budget, sel)
    # More budget keeps more mass, for the exact top pages at least.
    assert (results[("oracle", 0.02)]["recall"] <= results[("oracle", 0.05)]["recall"]
            <= results[("oracle", 0.10)]["recall"])
