"""The system description (dlrmv4/mlperf/system_desc.py): drafted from this machine with every field
mlperf-logging's system_desc_checker requires, the submitter's fields left empty and named, the real
checker's verdict, a submitter's file never written over."""

from __future__ import annotations

import json
import os

import pytest

from dlrmv4.cli import main
from dlrmv4.mlperf import system_desc as sd

SUBMITTERS = {
    "submitter": "Example Org",
    "division": "closed",
    "status": "Available on-premise",
    "host_processor_interconnect": "UPI",
    "host_storage_type": "NVMe SSD",
    "host_networking": "none",
    "host_networking_topology": "N/A",
    "host_memory_configuration": "16 x 64 GiB DDR5",
    "accelerator_on-chip_memories": "N/A",
    "accelerator_memory_configuration": "N/A",
    "accelerator_interconnect": "N/A",
    "accelerator_interconnect_topology": "N/A",
    "cooling": "air",
    "hw_notes": "",
    "sw_notes": "",
}


def test_the_draft_has_every_field_the_checker_requires_and_names_the_submitters(tmp_path):
    report = sd.write_system_desc(tmp_path / "systems", "box", 2, tmp_path)
    desc = json.loads(report.path.read_text())
    assert report.written and report.path == tmp_path / "systems" / "box.json"
    assert list(desc) == list(sd.REQUIRED_FIELDS)
    assert desc["system_name"] == "box" and desc["number_of_nodes"] == "2"
    assert desc["host_processor_vcpu_count"] == str(os.cpu_count())
    assert desc["framework"].startswith("PyTorch ")
    assert "mlperf-logging" in desc["other_software_stack"]
    # The real checker: nothing missing, and it fails on the empty status only.
    assert not report.checker_passed
    assert not any("Missing field" in p for p in report.checker_problems)
    assert any("Field status contains a non valid value" in p for p in report.checker_problems)
    # The fields left to fill are the submitter's, each empty in the file.
    assert {"submitter", "division", "status", "cooling"} <= set(report.to_fill)
    assert all(desc[f] == "" for f in report.to_fill)
    lines = sd.describe(report)
    assert "drafted from this machine" in lines[0]
    assert lines[1].startswith(f"{len(report.to_fill)} fields for the submitter to fill: submitter, division, status")
    assert "system_desc_checker (mlperf-logging " in lines[-1] and ": failed: " in lines[-1]


def test_each_required_field_is_one_the_checker_requires(tmp_path):
    desc = {**sd.draft("box", 1, tmp_path), **SUBMITTERS}
    path = tmp_path / "box.json"
    path.write_text(json.dumps(desc))
    assert sd.run_checker(path) == (True, [])
    for field in sd.REQUIRED_FIELDS:
        path.write_text(json.dumps({k: v for k, v in desc.items() if k != field}))
        passed, problems = sd.run_checker(path)
        assert not passed and f"Missing field {field}" in " ".join(problems)


def test_a_submitters_file_is_kept_and_checked_as_it_is(tmp_path):
    systems = tmp_path / "systems"
    first = sd.write_system_desc(systems, "box", 1, tmp_path)
    filled = {**json.loads(first.path.read_text()), **SUBMITTERS, "host_memory_capacity": "2 TB"}
    first.path.write_text(json.dumps(filled, indent=1))
    again = sd.write_system_desc(systems, "box", 4, tmp_path)
    assert not again.written and json.loads(again.path.read_text()) == filled  # not drafted over
    assert again.checker_passed and again.checker_problems == []
    assert again.to_fill == ["hw_notes", "sw_notes"]  # empty notes are named, and allowed
    assert "kept as it was" in sd.describe(again)[0] and sd.describe(again)[-1].endswith(": passed")


def test_the_systems_folder_sits_beside_the_results_layout(tmp_path):
    layout = tmp_path / "sub" / "results" / "box" / "dlrmv4"
    assert sd.systems_dir(layout, "box", tmp_path / "run") == tmp_path / "sub" / "systems"
    assert sd.systems_dir(tmp_path / "logs", "box", tmp_path / "run") == tmp_path / "run" / "systems"


def test_the_command_says_what_to_fill_and_fails_until_it_passes(tmp_path, capsys):
    systems = tmp_path / "systems"
    assert main(["system-desc", "box", "--systems-dir", str(systems), "--run-dir", str(tmp_path / "run")]) == 1
    out, err = capsys.readouterr()
    assert "fields for the submitter to fill: submitter" in out
    assert err.strip().splitlines() == [
        f"[dlrmv4] error: {systems / 'box.json'} does not pass system_desc_checker yet: fill the fields named above"
    ]
    path = systems / "box.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **SUBMITTERS}))
    assert main(["system-desc", "box", "--systems-dir", str(systems)]) == 0
    assert ": passed" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["../box", ".hidden", ""])
def test_a_bad_name_is_one_line(name, capsys):
    assert main(["system-desc", name]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"[dlrmv4] error: the system's name must be a plain file name, got {name!r}"
    ]
