"""Traces on object storage, for real: a real S3-compatible server (moto's standalone
server) on loopback, the sink writing s3:// traces from two rank processes (this one
and a child), `moetrace
audit s3://...` reading them, a killed writer leaving only complete parts, and DuckDB's
own S3 reader counting divergences per run over several runs. The endpoint and the
credentials reach every process the documented way: AWS_* environment variables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from support.traces import CheckpointModel

from moetrace import storage
from moetrace.cli import main

BUCKET = "moetrace-test"
OUT = f"s3://{BUCKET}/traces"

def write_rank(ckpt: str, out: str, rank: int, killed_after_first_part=None) -> None:
    """One rank's runs through the real TraceSink, as a server's rank writes them:
    "good"; "bad", where rank 1 holds expert 2 in expert 0's w2_weight_scale_inv slot
    (E+2) in its first load; "killed", where rank 1 keeps flushing parts until it is killed."""
    from support.traces import capture_load, open_rank

    model = CheckpointModel(ckpt, tp_size=2)
    e2 = {(0, "w2_weight_scale_inv"): ("expert", 2)}
    for run in ("good", "bad"):
        sink = open_rank(model, out, run, rank)
        for seq, layer in enumerate(model.layer_ids):
            bad = run == "bad" and rank == 1 and seq == 0
            capture_load(sink, model, 0, rank, layer, capture_seq=seq, corrupt=e2 if bad else None)
        assert sink.close(), sink.manifest()["errors"]
    sink = open_rank(model, out, "killed", rank)
    for seq in range(100_000 if rank == 1 else 2):
        capture_load(sink, model, seq, rank, model.layer_ids[0], capture_seq=seq)
        sink.flush()
        if seq == 0 and rank == 1:
            print("part written", flush=True)  # the test kills this process from here on
    assert sink.close()


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server on a free loopback port, its address and test credentials in
    the environment of this process and of every process it starts."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_EC2_METADATA_DISABLED": "true"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    fs, _ = storage.open_fs(f"s3://{BUCKET}?allow_bucket_creation=true")
    fs.create_dir(BUCKET)
    yield {"fs": fs, "endpoint": f"{host}:{port}"}
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture(scope="module")
def traces(s3, small_model, small_index):
    """Two rank processes write runs good, bad and killed to s3://; rank 1 is killed
    with SIGKILL while it is still writing parts of "killed"."""
    model, index = small_model, small_index
    child = subprocess.Popen([sys.executable, "-c", "import sys; from test_object_storage import write_rank; "
                              "write_rank(sys.argv[1], sys.argv[2], 1)", model.path, OUT], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    write_rank(model.path, OUT, 0)  # rank 0 in this process, rank 1 in the child, at the same time
    assert child.stdout.readline() == "part written\n", child.stderr.read()
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=120)
    return {"index": index, "model": model}


def audit(*args):
    return CliRunner().invoke(main, ["audit", *map(str, args)])


def test_audit_reads_traces_on_s3(traces):
    good = audit(f"{OUT}/good", "--index", traces["index"])
    assert good.exit_code == 0 and "ALL MATCH" in good.output, good.output
    bad = audit(f"{OUT}/bad", "--index", traces["index"])
    assert bad.exit_code == 1 and "holds expert 2 (E+2)" in bad.output, bad.output


def test_a_killed_writer_leaves_only_complete_parts(s3, traces):
    fs = s3["fs"]
    listing = fs.get_file_info(pafs.FileSelector(f"{BUCKET}/traces/killed", recursive=True))
    parts = [i.path for i in listing if i.base_name.startswith("part-")]
    assert parts and all(i.base_name.endswith(".parquet") for i in listing if i.base_name.startswith("part-"))
    for path in parts:  # every object under a part name is a whole Parquet file
        with fs.open_input_file(path) as f:
            assert pq.read_table(f).num_rows > 0
    manifest = json.loads(fs.open_input_stream(f"{BUCKET}/traces/killed/rank=1/_manifest.json").read())
    assert manifest["finished"] is False and manifest["parts"]
    r = audit(f"{OUT}/killed", "--index", traces["index"])
    assert r.exit_code == 2 and "rank 1 did not finish its trace" in r.output, r.output


def test_duckdb_counts_divergences_per_run_with_its_own_s3_reader(s3, traces):
    import duckdb
    import duckdb_ext  # the httpfs extension, from PyPI (no extension download offline)

    con = duckdb.connect(config={"extension_directory": os.path.join(list(duckdb_ext.__path__)[0], "extensions"),
                                 "autoinstall_known_extensions": False})
    con.execute("LOAD httpfs")
    con.execute(f"CREATE SECRET s3 (TYPE s3, KEY_ID 'test', SECRET 'test', REGION 'us-east-1', "
                f"ENDPOINT '{s3['endpoint']}', URL_STYLE 'path', USE_SSL false)")
    rows = con.execute(f"""
        SELECT t.run_id, count(*) FILTER (WHERE t.digest <> i.digest) AS divergent, count(*) AS rows
        FROM read_parquet('{OUT}/*/rank=*/part-*.parquet', hive_partitioning = false) t
        JOIN read_parquet('{traces["index"]}') i USING (model, moe_tp_rank, layer, expert, tensor)
        GROUP BY t.run_id ORDER BY t.run_id""").fetchall()
    per_run = {run: (divergent, n) for run, divergent, n in rows}
    assert set(per_run) == {"bad", "good", "killed"}
    assert per_run["good"][0] == 0 and per_run["killed"][0] == 0 and per_run["bad"][0] == 1
    assert per_run["good"][1] == per_run["bad"][1] > 0


def test_a_glob_of_runs_on_s3(traces):
    """A remote `*` matches run folders, never the files inside rank
    folders (`_claim.json is a file`)."""
    r = CliRunner().invoke(main, ["analyze", f"{OUT}/*", "--index", str(traces["index"])])
    assert r.exit_code == 0 and "is a file" not in r.output, r.output
    assert all(run in r.output for run in ("good", "bad")), r.output


class _Forbidden:
    """A loopback HTTP server that answers 403 to every request, as S3 does to bad keys."""

    def __enter__(self):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def _deny(self):
                self.send_response(403)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_HEAD = do_GET = do_PUT = _deny

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self.server.server_address[1]

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def no_aws(monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_EC2_METADATA_DISABLED": "true", "MOETRACE_REMOTE_TIMEOUT": "2"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)


def _one_line(r, *words):
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("moetrace: error: "), r.output
    assert "bug" not in lines[0] and all(w in lines[0] for w in words), lines[0]


def test_s3_faults_are_one_line_naming_the_endpoint_and_the_cause(no_aws, small_index):
    """A closed port, an endpoint that accepts and never answers, a
    403: exit 2, one line naming the endpoint and the cause, within the timeout (2 s
    here: a hang would stall this test, never pass it)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    url = "s3://bkt/traces/x?endpoint_override=http://127.0.0.1:{}"
    _one_line(audit(url.format(closed), "--index", small_index), f"127.0.0.1:{closed}", "connection refused")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # accepts (the kernel does), never answers
        port = silent.getsockname()[1]
        r = audit(url.format(port), "--index", small_index)
    _one_line(r, f"127.0.0.1:{port}")
    assert "within 2 s" in r.output or "timed out" in r.output, r.output
    with _Forbidden() as port:
        _one_line(audit(url.format(port), "--index", small_index), f"127.0.0.1:{port}", "access denied (403)")


def test_gcs_without_credentials_or_network_does_not_hang(no_aws, small_index):
    _one_line(audit("gs://moetrace-no-such-bucket/x", "--index", small_index), "gs://moetrace-no-such-bucket/x")


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "soon"])
def test_remote_timeout_must_be_a_finite_duration(no_aws, small_index, monkeypatch, value):
    monkeypatch.setenv("MOETRACE_REMOTE_TIMEOUT", value)
    _one_line(audit("s3://bkt/x", "--index", small_index), "MOETRACE_REMOTE_TIMEOUT")
