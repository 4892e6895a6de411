"""The Mooncake JSONL reader/writer: round trip, tolerated quirks, and the error for each malformed line."""

import json

import pytest
from kvmesh_bench.trace import TraceError, TraceRequest, load_trace, write_trace

GOOD = {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]}


def write_lines(tmp_path, lines, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_round_trip_keeps_every_field(tmp_path):
    rows = [
        TraceRequest(0, 1000, 10, (0, 1)),
        TraceRequest(1500, 600, 3, (0, 2), session_id="s-1", extra={"priority": 2}),
    ]
    path = tmp_path / "out.jsonl"
    assert write_trace(path, rows) == 2
    assert load_trace(path) == rows
    first, second = path.read_text().splitlines()
    assert first == '{"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]}'
    assert json.loads(second) == {
        "timestamp": 1500,
        "input_length": 600,
        "output_length": 3,
        "hash_ids": [0, 2],
        "session_id": "s-1",
        "priority": 2,
    }


def test_write_accepts_plain_dicts(tmp_path):
    path = tmp_path / "out.jsonl"
    write_trace(path, [GOOD])
    assert load_trace(path) == [TraceRequest(0, 1000, 10, (0, 1))]


def test_max_requests_blank_lines_and_tolerated_quirks(tmp_path):
    mismatched = {**GOOD, "input_length": 5000}  # 10 blocks of 512 would be needed: tolerated
    integral_float = {**GOOD, "timestamp": 2.0, "output_length": 7.0}
    path = write_lines(tmp_path, [json.dumps(GOOD), "", "   ", json.dumps(mismatched), json.dumps(integral_float)])
    rows = load_trace(path)
    assert [row.input_length for row in rows] == [1000, 5000, 1000]
    assert rows[2].timestamp_ms == 2 and isinstance(rows[2].timestamp_ms, int) and rows[2].output_length == 7
    assert len(load_trace(path, max_requests=2)) == 2
    # a malformed line after the first max_requests rows is never read
    broken = write_lines(tmp_path, [json.dumps(GOOD), "{oops"], name="broken.jsonl")
    assert len(load_trace(broken, max_requests=1)) == 1


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ('{"timestamp": 0, "input_length": 1', "invalid JSON"),
        ("[1, 2, 3]", "expected a JSON object, got list"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing field 'hash_ids'"),
        ('{"input_length": 10, "hash_ids": []}', "missing fields 'timestamp', 'output_length'"),
        ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}', "'input_length' must be a"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1.5, "hash_ids": []}', "'output_length' must be a"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": []}', "'timestamp' must be a non-neg"),
        ('{"timestamp": "0", "input_length": 5, "output_length": 1, "hash_ids": []}', "'timestamp' must be a non-neg"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 7}', "'hash_ids' must be a list of int"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, "x"]}', 'element 1 is "x"'),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2.5]}', "element 1 is 2.5"),
        ('{"timestamp": 0, "input_length": true, "output_length": 1, "hash_ids": []}', "'input_length' must be"),
    ],
)
def test_malformed_line_reports_line_number_and_reason(tmp_path, line, reason):
    path = write_lines(tmp_path, [json.dumps(GOOD), line, json.dumps(GOOD)])
    with pytest.raises(TraceError) as caught:
        load_trace(path)
    assert caught.value.line == 2
    assert str(caught.value).startswith(f"{path}:2: ")
    assert reason in str(caught.value)


def test_invalid_utf8_reports_line(tmp_path):
    path = tmp_path / "bin.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceError, match=r":2: not valid UTF-8"):
        load_trace(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_trace_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(TraceError, match="empty") as caught:
        load_trace(path)
    assert caught.value.line is None


def test_missing_file_is_a_trace_error(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")
