"""`benchmarks/run_all.py`: runs the chosen items, prints one table of ratios, says what
failed or was skipped, and draws the overlap-efficiency curve."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "run_all.py"


def _module() -> Any:
    spec = importlib.util.spec_from_file_location("run_all_benchmarks", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    return module


def test_a_quick_run_prints_the_machine_and_a_table_of_ratios(tmp_path: Path) -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--only", "workspace,handoff",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[0].startswith("Date: ") and lines[1].startswith("Machine: "), lines
    assert "torch " in lines[1] and "cores" in lines[1], lines[1]
    assert lines[2].startswith("Command: `python benchmarks/run_all.py --quick"), lines[2]
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 2, rows  # the workspace cases on CPU, the handoff comparisons
    for row in rows:
        what, ratios, meaning = (cell.strip() for cell in row.strip("|").split("|"))
        assert what and meaning, row
        assert all(float(ratio) > 0 for ratio in ratios.split(" / ")), row
    assert "[1/2] workspace" in completed.stderr and "[2/2] handoff" in completed.stderr
    assert (tmp_path / "table.md").read_text().count("\n| ") == 3  # header and 2 rows
    assert (tmp_path / "handoff.json").exists() and (tmp_path / "workspace.log").exists()


def test_an_unknown_item_is_refused_with_the_names_to_choose_from() -> None:
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "handoff,nonsense"],
        capture_output=True, text=True, timeout=60,
    )
    assert completed.returncode == 2
    assert "nonsense" in completed.stderr and "workspace,handoff" in completed.stderr


def test_failed_timed_out_and_missing_items_leave_a_row_and_exit_status_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_all = _module()
    scripts = {
        "good.py": 'import json; print("human output"); print(json.dumps({"x": 2.0}))',
        "bad.py": "raise SystemExit(3)",
        "slow.py": "import time; time.sleep(30)",
        "mute.py": 'print("no json")',
    }
    for name, text in scripts.items():
        (tmp_path / name).write_text(text)

    def rows(result: dict[str, Any]) -> list[tuple[str, str, str]]:
        return [("good ratio", f"{result['x']:.2f}", "twice")]

    items = tuple(
        run_all.Item(name.removesuffix(".py"), name, (), (), rows)
        for name in [*scripts, "absent.py"]
    )
    monkeypatch.setattr(run_all, "ROOT", tmp_path)
    monkeypatch.setattr(run_all, "ITEMS", items)
    status = run_all.main(["--out", str(tmp_path / "out"), "--timeout-s", "2"])
    table = capsys.readouterr().out
    assert status == 1
    assert "| good ratio | 2.00 | twice |" in table
    assert "| `bad.py` | failed | failed (exit status 3);" in table
    assert "| `slow.py` | failed | timed out after 2 s;" in table
    assert "| `mute.py` | failed | no JSON line at the end of its output;" in table
    assert "| `absent.py` | skipped |" in table
    assert (tmp_path / "out" / "good.log").read_text().startswith("human output")


def test_the_overlap_curve_is_drawn_with_one_line_per_ubatch_count(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_all = _module()
    result = {"device": "cpu", "layers": 4, "rows": [
        {"c_nominal_ms": size, "m_ms": size, "num_ubatches": u, "hidden": 0.5 + size / 10}
        for u in (2, 3, 4) for size in (0.25, 1.0, 4.0)
    ]}
    path = tmp_path / "curve.png"
    assert run_all.plot_overlap(result, path) == f"overlap-efficiency curve: {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (row,) = run_all._overlap_rows(result)
    assert row[1] == "0.53 / 0.60 / 0.90 ; 0.53 / 0.60 / 0.90 ; 0.53 / 0.60 / 0.90", row
    assert "2 ; 3 ; 4 ubatches, c = m = 0.25 / 1 / 4 ms" in row[0], row


def test_hidden_fractions_far_outside_0_to_1_get_a_note_under_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    run_all = _module()
    result = {"device": "cpu", "layers": 4, "rows": [
        {"c_nominal_ms": 1.0, "m_ms": 1.0, "num_ubatches": 2, "hidden": hidden}
        for hidden in (0.9, -3.0)
    ]}
    (tmp_path / "fake_overlap.py").write_text(f"import json; print(json.dumps({result!r}))")
    item = run_all.Item("overlap", "fake_overlap.py", (), (), lambda result: [])
    monkeypatch.setattr(run_all, "ROOT", tmp_path)
    monkeypatch.setattr(run_all, "ITEMS", (item,))
    assert run_all.main(["--out", str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out
    assert "a busy machine" in printed
    assert (tmp_path / "out" / "overlap_efficiency.png").exists()


def test_the_moe_paths_row_gives_fixed_over_dynamic_per_size_and_the_host_reads() -> None:
    run_all = _module()
    rows = [
        {"tokens": t, "path": path, "whole_ms": whole, "dbo_ms": dbo_ms,
         "host_reads_per_step": reads}
        for t, path, whole, dbo_ms, reads in [
            (16, "dynamic", 10.0, 8.0, 4), (16, "fixed", 5.0, 6.0, 0),
            (64, "dynamic", 20.0, 10.0, 4), (64, "fixed", 30.0, 5.0, 0),
        ]
    ]
    ((what, ratios, meaning),) = run_all._moe_path_rows({"rows": rows})
    assert "16 / 64 tokens per rank" in what
    assert ratios == "0.50 / 1.50; 0.75 / 0.50"  # no "|": it would split the table cell
    assert "host reads per whole-batch step 0 (fixed) vs 4 (dynamic)" in meaning
