"""The one Azure trace reader (loadtests/traces/azure.py): the simulator and the benchmark workloads
read the same records from the same file."""

from __future__ import annotations

from loadtests.load.trace_workloads import azure
from loadtests.load.workloads import TokenSource
from loadtests.traces.formats import load_any

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:04.5000000,300,10
2023-11-16 18:17:03.9799600,700,20
2023-11-16 18:17:04.5000000,100,0
"""


def test_records_in_arrival_order_and_the_workload_follows_them(tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(CSV)
    records = load_any(path)
    assert [r.input_length for r in records] == [700, 300, 100]  # by time; the tie keeps file order
    assert [round(r.timestamp_ms, 3) for r in records] == [0.0, 520.04, 520.04]
    assert records[2].output_length == 1  # at least one token, as a request needs
    requests = azure(path, "azure_code", TokenSource(1000), None, 512, 16, time_scale=0.5)
    assert [len(r.prompt_token_ids) for r in requests] == [512, 300, 100]
    assert [round(r.arrival_s, 5) for r in requests] == [0.0, 0.26002, 0.26002]
    assert [r.max_tokens for r in requests] == [16, 10, 1]
