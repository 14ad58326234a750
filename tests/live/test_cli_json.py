"""`epd-transfer doctor --json FILE` on this host: the text report on stdout, the JSON document in FILE,
and stderr naming where it went (the doctor probes Mooncake in a subprocess, hence live)."""

from __future__ import annotations

import json

import pytest

from transfer import cli

pytestmark = pytest.mark.live


def test_doctor_json_file_keeps_the_text_report_and_writes_the_document(tmp_path, capsys):
    from transfer import doctor

    dest = tmp_path / "doctor.json"
    code = cli.main(["doctor", "--json", str(dest)])
    captured = capsys.readouterr()
    report = json.loads(dest.read_text())
    assert code == (0 if report["data_path_ok"] else 1)
    assert "protocol" in captured.out and not captured.out.lstrip().startswith("{")
    assert f"wrote JSON to {dest}" in captured.err
    assert set(report) == set(doctor.collect_report().as_dict())
