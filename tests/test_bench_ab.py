"""bench/ab_bwd_main.py's comparison on the CPU: two runs' JSON lines side by side, the main kernel, the sum of
every kernel the backward launches (a change that moves work between kernels shows there, not in the main kernel
alone), the whole backward, and each kernel of either run; files from before the passes were timed still compare."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import ab_bwd_main  # noqa: E402


def _write(path: Path, *rows: dict) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in ({"fagen": "tree"}, *rows)))
    return str(path)


def test_compare_shows_the_passes_and_each_kernel(tmp_path, capsys):
    case = dict(case="d128-causal-2048", kernel="main", ok=True, check="")
    old = _write(
        tmp_path / "old.jsonl",
        {**case, "main_us": 624.0, "passes_us": 740.0, "kernels_us": {"main": 624.0, "convert": 50.0}, "bwd_us": 760.0},
        dict(case="d64-full-2048", kernel="main", ok=True, check="", main_us=1400.0, bwd_us=1500.0),
    )
    new = _write(
        tmp_path / "new.jsonl",
        {**case, "main_us": 740.0, "passes_us": 800.0, "kernels_us": {"main": 740.0, "fill": 21.0}, "bwd_us": 800.0},
        dict(case="d64-full-2048", kernel="main", ok=False, check="", main_us=1500.0, passes_us=1.0, bwd_us=1600.0),
    )
    ab_bwd_main.compare(old, new)
    lines = capsys.readouterr().out.splitlines()
    row = lines[1].split()
    assert row[0] == "d128-causal-2048" and row[-1] == "ok"
    assert [float(x) for x in row[1:-1]] == [624, 740, round(624 / 740, 3), 740, 800, 0.925, 760, 800, 0.95]
    kernels = {line.split()[0]: line.split()[1:] for line in lines[2:5]}
    assert kernels == {"convert": ["50", "-"], "fill": ["-", "21"], "main": ["624", "740"]}
    last = lines[5].split()
    assert last[0] == "d64-full-2048" and last[4:7] == ["-", "-", "-"] and last[-1] == "FAIL"
