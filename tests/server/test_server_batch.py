"""The Files and Batch APIs through the official openai client: jobs whose answers equal
direct requests, bad files, cancellation, a server killed with SIGKILL mid-job that resumes
without redoing or losing a line, and a full disk under the batch store."""

from __future__ import annotations

import io
import json
import random
import signal
import sqlite3
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_harness import serve, tiny_model  # noqa: F401  (tiny_model: fixture)

from oxserve.faults import FAULTS_ENV
from oxserve.llm import LLM
from oxserve.sampling_params import SamplingParams

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _line(custom_id: str, body: dict, url: str = "/v1/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def _upload(client: openai.OpenAI, lines: list[dict]):
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    return client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")


def _wait(client: openai.OpenAI, batch_id: str, until, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while not until(batch := client.batches.retrieve(batch_id)):
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
    return batch


def _ended(batch) -> bool:
    return batch.status in ("completed", "failed", "cancelled")


def _jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(20, 8000) for _ in range(rng.randrange(3, 12))] for _ in range(n)]


def test_a_batch_job_answers_as_direct_requests_do(tiny_model, tmp_path):
    """Completions and chat lines, one of them invalid: the valid ones land in the output file
    with the very answers direct requests get (deterministic mode: batching cannot move them),
    the invalid one in the error file with its 400, and the counts add up."""
    rng = random.Random()
    with serve(tiny_model, "--deterministic", log_dir=tmp_path) as s:
        client = s.client()
        prompts = _prompts(rng, 4)
        lines = [_line(f"c{i}", {"prompt": p, "max_tokens": rng.randrange(2, 9), **GREEDY}) for i, p in enumerate(prompts)]
        bad = rng.randrange(len(lines))
        lines[bad]["body"]["max_tokens"] = 0
        file = _upload(client, lines)
        assert client.files.retrieve(file.id).bytes == file.bytes and file.purpose == "batch"
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h",
                                      metadata={"job": "test"})  # fmt: skip
        assert batch.status == "in_progress" and batch.metadata == {"job": "test"}
        done = _wait(client, batch.id, _ended)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 3, 1)
        output, errors = _jsonl(client, done.output_file_id), _jsonl(client, done.error_file_id)
        assert [x["custom_id"] for x in output] == [f"c{i}" for i in range(4) if i != bad]
        assert [x["custom_id"] for x in errors] == [f"c{bad}"]
        assert errors[0]["response"]["status_code"] == 400 and "max_tokens" in errors[0]["error"]["message"]
        for x in output:
            i = int(x["custom_id"][1:])
            direct = client.completions.create(model=client.models.list().data[0].id, **{k: v for k, v in lines[i]["body"].items()
                                                                           if k not in GREEDY}, extra_body=GREEDY)  # fmt: skip
            assert x["response"]["status_code"] == 200 and x["error"] is None
            assert x["response"]["body"]["choices"][0]["text"] == direct.choices[0].text
        assert [b.id for b in client.batches.list()] == [batch.id]
        # Listings page by cursor, newest first; the client follows the pages.
        files = {done.output_file_id, done.error_file_id, file.id, _upload(client, lines[:1]).id}
        listed = [f.id for f in client.files.list(limit=1)]
        assert sorted(listed) == sorted(files) and listed[-1] == file.id
        assert client.files.delete(file.id).deleted and file.id not in [f.id for f in client.files.list()]


@pytest.mark.parametrize("lines, code", [
    ([_line("a", {"prompt": "x"}), _line("a", {"prompt": "y"})], "duplicate_custom_id"),
    ([_line("a", {"prompt": "x"}, url="/v1/embeddings")], "invalid_url"),
    ([_line("a", {"prompt": "x", "stream": True})], "invalid_request"),
    ([], "empty_file"),
])  # fmt: skip
def test_an_unusable_file_fails_the_batch_with_its_errors(tiny_model, tmp_path, lines, code):
    with serve(tiny_model, log_dir=tmp_path) as s:
        client = s.client()
        file = _upload(client, lines)
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        assert batch.status == "failed" and batch.errors.data[0].code == code
        with pytest.raises(openai.NotFoundError):
            client.batches.create(input_file_id="file-missing", endpoint="/v1/completions", completion_window="24h")
        with pytest.raises(openai.BadRequestError):
            client.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")


def test_cancel_stops_a_job_and_keeps_what_it_answered(tiny_model, tmp_path):
    with serve(tiny_model, "--batch-concurrency", "1", log_dir=tmp_path) as s:
        client = s.client()
        lines = [_line(f"c{i}", {"prompt": [11, 12, 13], "max_tokens": 40, **GREEDY}) for i in range(30)]
        batch = client.batches.create(input_file_id=_upload(client, lines).id, endpoint="/v1/completions",
                                      completion_window="24h")  # fmt: skip
        _wait(client, batch.id, lambda b: b.request_counts.completed >= 1)
        assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
        done = _wait(client, batch.id, _ended)
        assert done.status == "cancelled" and 1 <= done.request_counts.completed < 30
        assert len(_jsonl(client, done.output_file_id)) == done.request_counts.completed
        with pytest.raises(openai.ConflictError):
            client.batches.cancel(batch.id)
        assert s.metrics()["oxserve:num_requests_running"] == 0


@pytest.mark.slow
def test_a_job_survives_sigkill_and_resumes_without_redoing_a_line(tiny_model, tmp_path):
    """SIGKILL mid-job, then a new server on the same store: the job completes with every line
    answered once, the restarted server generates only the lines that had no committed answer,
    and the answers equal direct requests (deterministic mode)."""
    rng = random.Random()
    store = tmp_path / "batches.sqlite"
    args = ("--deterministic", "--batch-concurrency", "1", "--batch-store", str(store))
    lines = [_line(f"c{i}", {"prompt": p, "max_tokens": 12, **GREEDY}) for i, p in enumerate(_prompts(rng, 10))]
    with serve(tiny_model, *args, log_dir=tmp_path) as s:
        client = s.client()
        batch = client.batches.create(input_file_id=_upload(client, lines).id, endpoint="/v1/completions",
                                      completion_window="24h")  # fmt: skip
        _wait(client, batch.id, lambda b: b.request_counts.completed >= 2)
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait()
    with sqlite3.connect(store) as db:
        committed = db.execute("SELECT COUNT(response) FROM lines").fetchone()[0]
    assert 2 <= committed < len(lines)
    with serve(tiny_model, *args, log_dir=tmp_path) as s:
        client = s.client()
        done = _wait(client, batch.id, _ended)
        assert done.status == "completed" and done.request_counts.completed == len(lines)
        output = _jsonl(client, done.output_file_id)
        assert sorted(x["custom_id"] for x in output) == sorted(x["custom_id"] for x in lines)
        assert s.metrics()["oxserve:generation_tokens_total"] == 12 * (len(lines) - committed)
        for x in rng.sample(output, 3):
            body = lines[int(x["custom_id"][1:])]["body"]
            direct = httpx.post(s.base_url + "/v1/completions", json=body, timeout=60).json()
            assert x["response"]["body"]["choices"][0]["text"] == direct["choices"][0]["text"]


def test_lines_caught_in_an_engine_death_stay_unanswered_for_the_restart(tiny_model, tmp_path):
    """The engine loop dies mid-job (planted): the lines it held fail with a 500 over HTTP, but
    that is not their answer, so none is committed; the restarted server answers them all."""
    store = tmp_path / "batches.sqlite"
    lines = [_line(f"c{i}", {"prompt": [11, 12, 13], "max_tokens": 20, **GREEDY}) for i in range(12)]
    faults = {FAULTS_ENV: json.dumps({"crash_loop_after_steps": 10})}
    with serve(tiny_model, "--batch-store", str(store), log_dir=tmp_path, env=faults) as s:
        client = s.client()
        batch = client.batches.create(input_file_id=_upload(client, lines).id, endpoint="/v1/completions",
                                      completion_window="24h")  # fmt: skip
        assert s.proc.wait(timeout=60) == 1
    with sqlite3.connect(store) as db:
        answered, failed = db.execute("SELECT COUNT(response), COUNT(CASE WHEN status_code != 200 THEN 1 END) FROM lines").fetchone()
    assert failed == 0 and answered < len(lines)
    with serve(tiny_model, "--batch-store", str(store), log_dir=tmp_path) as s:
        done = _wait(s.client(), batch.id, _ended)
        assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (len(lines), 0)


def test_a_full_disk_pauses_the_job_and_interactive_requests_go_on(tiny_model, tmp_path):
    """The batch store may not grow (a planted SQLITE_FULL): a job whose answers cannot be
    written waits instead of losing them, a large upload gets a 507, and direct requests
    are served meanwhile."""
    with serve(tiny_model, log_dir=tmp_path, env={FAULTS_ENV: json.dumps({"batch_store_max_pages": 12})}) as s:
        client = s.client()
        lines = [_line(f"c{i}", {"prompt": [11, 12, 13], "max_tokens": 60, "logprobs": 5, **GREEDY}) for i in range(6)]
        batch = client.batches.create(input_file_id=_upload(client, lines).id, endpoint="/v1/completions",
                                      completion_window="24h")  # fmt: skip
        deadline = time.monotonic() + 60
        while "the store cannot write" not in s.log():
            assert time.monotonic() < deadline, s.log()
            time.sleep(0.1)
        assert client.batches.retrieve(batch.id).status == "in_progress"
        answer = client.completions.create(model=client.models.list().data[0].id, prompt=[11, 12], max_tokens=3)
        assert answer.usage.completion_tokens == 3
        big = io.BytesIO(b"x" * 200_000)
        r = httpx.post(s.base_url + "/v1/files", files={"file": ("big.jsonl", big)}, data={"purpose": "batch"})
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage"


def test_run_batch_answers_a_file_offline_in_input_order(tiny_model, tmp_path):
    """`oxserve run-batch`: every line answered, in input order, successes and errors in one
    file, and the texts those of the offline engine (deterministic mode)."""
    rng = random.Random()
    prompts = _prompts(rng, 5)
    lines = [_line(f"c{i}", {"prompt": p, "max_tokens": 6, **GREEDY}) for i, p in enumerate(prompts)]
    lines.append(_line("chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **GREEDY}, url="/v1/chat/completions"))
    lines.append(_line("two", {"prompt": prompts[0], "max_tokens": 6, "n": 2, **GREEDY}))  # two queue places
    lines.append(_line("bad", {"prompt": [999999]}))
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(x) + "\n" for x in lines))
    done = subprocess.run([sys.executable, "-m", "oxserve.cli", "run-batch", "-i", str(source), "-o", str(target), "--model",
                           str(tiny_model), "--dtype", "float32", "--deterministic", "--max-model-len", "128"],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    output = [json.loads(x) for x in target.read_text().splitlines()]
    assert [x["custom_id"] for x in output] == [x["custom_id"] for x in lines]
    assert [x["response"]["status_code"] for x in output] == [200] * 7 + [400]
    assert "vocabulary" in output[-1]["error"]["message"]
    assert output[5]["response"]["body"]["object"] == "chat.completion"
    llm = LLM(model=str(tiny_model), dtype="float32", deterministic=True, max_model_len=128)
    expected = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [x["response"]["body"]["choices"][0]["text"] for x in output[:5]] == [e.outputs[0].text for e in expected]
    assert [c["text"] for c in output[6]["response"]["body"]["choices"]] == [expected[0].outputs[0].text] * 2
