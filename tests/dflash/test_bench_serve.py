"""``dflash bench serve`` against a server that speaks as vLLM and SGLang do.

No GPU engine runs here: the server is ``EngineDouble`` (testkit/engine_double.py), a real HTTP server
on 127.0.0.1 whose /metrics are the engines' own names, label sets and exposition text (prometheus_client),
with counters that move per request as the engines' do.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash.__main__ import main
from dflash.serve import engine_metrics
from dflash.serve.serve_bench import Cliff, find_cliff, percentile, sha256_file
from testkit import free_port
from testkit.engine_double import EngineDouble

REPO = Path(__file__).resolve().parents[2]
# the double's cycle (3, 1, 2, 0): requests of 1 + 2 * 10 tokens take 8 verify steps, accepting 12 drafts
TOKENS = 21
VLLM_AL = 1 + (3 + 1 + 2 + 0) / 4
CASES = ("unreachable", "no-drafter", "concurrency", "empty", "both", "not-a-report")

pytestmark = pytest.mark.timeout(240)


def chat_prompts(path: Path, n: int = 5) -> Path:
    path.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) + "\n" for i in range(n))
    )
    return path


def only_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ": concurrency " not in ln]  # progress lines
    assert len(err) == 1, err
    return err[0]


def test_vllm_acceptance_from_its_counters_beside_the_offline_tau_of_the_same_prompts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = chat_prompts(tmp_path / "eval.jsonl")
    report = tmp_path / "eval.json"  # what `dflash eval --json` writes (the keys bench serve reads)
    report.write_text(
        json.dumps(
            {
                "tau": 2.41,
                "max_new_tokens": TOKENS,
                "position_acceptance": [0.7, 0.45, 0.2],
                "protocol": {
                    "prompts_sha256": sha256_file(prompts),
                    "chat_template_kwargs": {"enable_thinking": False},
                    "stop_at_eos": True,
                },
            }
        )
    )
    out = tmp_path / "bench.json"
    with EngineDouble("vllm") as engine:
        args = ["bench", "serve", "--server", engine.url, "--prompts", str(prompts), "--concurrency", "1,3"]
        assert main([*args, "--eval", str(report), "--json", str(out)]) == 0
        sent = list(engine.requests)
    got = json.loads(out.read_text())
    assert got["engine"] == "vllm" and got["model"] == "tiny-target" and got["num_prompts"] == 5
    assert got["max_new_tokens"] == TOKENS  # the report's: the same protocol as the offline figure
    assert [lv["concurrency"] for lv in got["levels"]] == [1, 3]
    for lv in got["levels"]:
        assert lv["requests"] == 5 and lv["output_tokens"] == 5 * TOKENS
        assert lv["acceptance_length"] == VLLM_AL and lv["acceptance_source"] == "vllm counters"
        assert lv["drafts"] == 5 * 8 and lv["accepted_tokens"] == 5 * 12 and lv["draft_tokens"] == 5 * 8 * 3
        assert lv["position_acceptance"] == [0.75, 0.5, 0.25]
        lat = lv["latency_s"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"]
        assert lv["output_tokens_per_s"] == pytest.approx(lv["output_tokens"] / lv["seconds"])
    assert got["offline"]["tau"] == 2.41 and got["offline"]["same_prompts"] is True
    # a warm-up request, then every prompt once per level; greedy, the report's template kwargs
    assert len(sent) == 1 + 2 * 5
    assert all(b["temperature"] == 0 and b["max_tokens"] == TOKENS for b in sent)
    assert all(b["chat_template_kwargs"] == {"enable_thinking": False} and "ignore_eos" not in b for b in sent)
    assert sorted(b["messages"][0]["content"] for b in sent[1:6]) == [f"question {i}" for i in range(5)]
    text = capsys.readouterr().out.splitlines()
    assert text[0].startswith("server:  http://127.0.0.1:") and text[0].endswith("(vLLM 0.33.0, model tiny-target)")
    assert got["engine_version"] == "0.33.0" and got["max_running_requests"] is None
    assert got["model_card"] == {
        "id": "tiny-target",
        "root": "/models/tiny-target",
        "parent": None,
        "max_model_len": 4096,
        "owned_by": "vllm",
    }
    assert all(lv["cliff"] is None and lv["acceptance_none"] is None for lv in got["levels"])
    assert all("return_spec_tokens_details" not in b for b in sent)  # SGLang's: vLLM is not asked for it
    assert text[3].split()[:3] == ["1", "5", str(5 * TOKENS)] and text[3].endswith("2.50 (40 drafts)")
    assert "acceptance by position (1..B-1), concurrency 1: 0.75 0.50 0.25" in text
    assert "acceptance by position (1..B-1), concurrency 3: 0.75 0.50 0.25" in text  # every level's
    assert (
        f"offline tau (dflash eval, {report}): 2.41 on the same prompts file (sha256), up to 21 new tokens each" in text
    )


# SGLang's acceptance length is completion tokens / verify steps: 21 tokens in 8 verify steps per request
SGLANG_AL = TOKENS / 8


def test_sglang_exact_acceptance_from_its_counters_and_each_requests_details(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = chat_prompts(tmp_path / "eval.jsonl")
    out = tmp_path / "bench.json"
    # the default log interval (40 steps) leaves the gauge at whatever interval it last logged: not read
    with EngineDouble("sglang") as engine:
        args = ["bench", "serve", "--server", engine.url, "--prompts", str(prompts), "--concurrency", "1,3"]
        assert main([*args, "--max-new", str(TOKENS), "--json", str(out)]) == 0
        sent = list(engine.requests)
    got = json.loads(out.read_text())
    assert got["engine"] == "sglang" and got["engine_version"] == "0.5.23" and got["max_running_requests"] == 48
    for lv in got["levels"]:
        assert lv["acceptance_length"] == SGLANG_AL and lv["drafts"] == 5 * 8  # verify steps
        assert lv["acceptance_source"] == (
            "sglang counters (generation tokens / verify calls); by position from each request's spec_tokens_details"
        )
        assert lv["position_acceptance"] == [0.75, 0.5, 0.25]  # steps that accepted at least k drafts
    assert all(b["return_spec_tokens_details"] is True for b in sent)
    text = capsys.readouterr().out.splitlines()
    assert text[0].endswith("(SGLang 0.5.23, model tiny-target)")
    assert text[3].endswith("2.62 (40 verify steps)")
    assert "acceptance by position (1..B-1), concurrency 3: 0.75 0.50 0.25" in text
    assert not [ln for ln in text if "max_running_requests" in ln]  # no level above 48


def test_sglang_without_counters_reads_each_requests_details_and_says_so(tmp_path: Path) -> None:
    prompts = chat_prompts(tmp_path / "eval.jsonl", 3)
    out = tmp_path / "bench.json"
    with EngineDouble("sglang", counters=False) as engine:
        args = ["bench", "serve", "--server", engine.url, "--prompts", str(prompts), "--concurrency", "2"]
        assert main([*args, "--max-new", str(TOKENS), "--json", str(out)]) == 0
    (level,) = json.loads(out.read_text())["levels"]
    assert level["acceptance_length"] == SGLANG_AL and level["position_acceptance"] == [0.75, 0.5, 0.25]
    assert level["acceptance_source"] == (
        "sglang per-request spec_tokens_details (this build has no sglang:spec_verify_calls_total)"
    )


def test_a_level_above_sglangs_max_running_requests_says_it_queues(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = chat_prompts(tmp_path / "eval.jsonl", 4)
    with EngineDouble("sglang", max_running_requests=2) as engine:
        args = ["bench", "serve", "--server", engine.url, "--prompts", str(prompts), "--concurrency", "2,4"]
        assert main([*args, "--max-new", str(TOKENS)]) == 0
    text = capsys.readouterr().out.splitlines()
    assert [ln for ln in text if "max_running_requests" in ln] == [
        "concurrency 4: above SGLang's max_running_requests 2 (/server_info): the requests past it queue, so at "
        "most 2 are decoded at once"
    ]


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_a_per_position_cliff_is_flagged_beside_the_offline_acceptance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flavor: str
) -> None:
    """Block 8, every step accepting 3 or 4 drafts and never a 5th: positions 1-4 high, 5-7 zero (what an
    engine serving sliding layers as full attention shows), while offline the drafter accepts there."""
    prompts = chat_prompts(tmp_path / "eval.jsonl", 3)
    report = tmp_path / "eval.json"
    report.write_text(json.dumps({"tau": 4.1, "position_acceptance": [0.9, 0.85, 0.8, 0.7, 0.6, 0.5, 0.4]}))
    out = tmp_path / "bench.json"
    with EngineDouble(flavor, block_size=8, accepted=(4, 4, 4, 3)) as engine:
        args = ["bench", "serve", "--server", engine.url, "--prompts", str(prompts), "--concurrency", "1"]
        assert main([*args, "--max-new", str(TOKENS), "--eval", str(report), "--json", str(out)]) == 0
    (level,) = json.loads(out.read_text())["levels"]
    assert level["position_acceptance"] == [1.0, 1.0, 1.0, 0.8, 0.0, 0.0, 0.0]
    assert level["cliff"] == {"position": 5, "before": 0.8, "after": 0.0}
    assert capsys.readouterr().out.splitlines()[-1] == (
        "cliff at concurrency 1: acceptance by position falls from 0.80 at position 4 to 0.00 at position 5 and "
        "stays near 0; offline (dflash eval) 0.60 there: the engine, not the drafter (sliding layers served as "
        "full attention, or other target layers captured)"
    )


def test_no_cliff_for_a_drafters_own_decay() -> None:
    assert find_cliff([0.88, 0.76, 0.64, 0.52, 0.39, 0.27, 0.15]) is None
    assert find_cliff([0.6, 0.3, 0.1, 0.03, 0.01, 0.0, 0.0]) is None  # it fades: no position before is high
    assert find_cliff([0.9, 0.25, 0.01, 0.0]) == Cliff(3, 0.25, 0.01)


def test_sglang_acceptance_from_its_gauge_with_token_and_text_prompts(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [5, 6, 7]}) + "\n" + json.dumps({"prompt": "Once upon a time"}) + "\n")
    out = tmp_path / "bench.json"
    # a build with neither counters nor per-request details; one log interval = one cycle of the double's
    # acceptance: the gauge reads exactly its mean
    with EngineDouble("sglang", log_interval=4, counters=False, spec_details=False) as engine:
        args = ["bench", "serve", "--server", engine.url, "--prompts", str(prompts), "--concurrency", "2"]
        assert main([*args, "--max-new", str(TOKENS), "--ignore-eos", "--json", str(out)]) == 0
        sent = list(engine.requests)
        gauge = engine_metrics.read(engine.metrics_text()).accept_length
    got = json.loads(out.read_text())
    (level,) = got["levels"]
    assert got["engine"] == "sglang" and got["ignore_eos"] is True
    assert level["acceptance_length"] == gauge == VLLM_AL
    assert level["acceptance_source"] == (
        "sglang gauge (last log interval; this build has no sglang:spec_verify_calls_total)"
    )
    assert level["drafts"] is None
    assert {json.dumps(b["prompt"]) for b in sent} == {"[5, 6, 7]", '"Once upon a time"'}
    assert all(b["ignore_eos"] is True and "messages" not in b for b in sent)


@pytest.mark.parametrize(
    ("case", "line"),
    [
        ("unreachable", "bench serve: cannot reach http://127.0.0.1:{port}/metrics: [Errno 111] Connection refused"),
        (
            "no-drafter",
            "bench serve: {url}/metrics has no speculative-decoding metrics (vllm:spec_decode_num_drafts_total or "
            "sglang:spec_accept_length): is a drafter served (vLLM --speculative-config, SGLang "
            "--speculative-algorithm DFLASH --enable-metrics)?",
        ),
        (
            "concurrency",
            "bench serve: --concurrency: expected positive integers separated by commas, such as 1,8,32; got '1,eight'",
        ),
        ("empty", "bench serve: --prompts: no prompts in {tmp}/empty.jsonl"),
        ("both", "bench serve: give --eval REPORT or --drafter CKPT, not both"),
        ("not-a-report", "bench serve: --eval: {tmp}/p.jsonl is not JSON (Extra data: line 2 column 1 (char 58))"),
    ],
    ids=lambda v: v if v in CASES else "",
)
def test_bad_inputs_are_refused_in_one_line_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, line: str
) -> None:
    prompts = chat_prompts(tmp_path / "p.jsonl", 2)
    (tmp_path / "empty.jsonl").write_text("\n")
    with EngineDouble("vllm", spec=case != "no-drafter") as engine:
        port = free_port()
        server = f"http://127.0.0.1:{port}" if case == "unreachable" else engine.url
        args = ["bench", "serve", "--server", server, "--prompts", str(prompts)]
        extra = {
            "concurrency": ["--concurrency", "1,eight"],
            "empty": ["--prompts", str(tmp_path / "empty.jsonl")],
            "both": ["--eval", "r.json", "--drafter", "ck"],
            "not-a-report": ["--eval", str(prompts)],
        }.get(case, [])
        assert main([*args, *extra]) == 2
        assert engine.requests == []
    assert only_line(capsys) == line.format(port=port, url=engine.url, tmp=tmp_path)


def test_a_server_that_fails_during_the_run_ends_it_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = chat_prompts(tmp_path / "p.jsonl", 2)
    with EngineDouble("vllm", fail_status=404) as engine:
        assert main(["bench", "serve", "--server", engine.url, "--prompts", str(prompts)]) == 1
    assert only_line(capsys) == (
        f"bench serve: {engine.url}/v1/chat/completions answered 404 Not Found: The model does not exist."
    )


def test_the_offline_tau_computed_here_is_dflash_evals_on_the_same_prompts(tmp_path: Path) -> None:
    from dflash.config import load_config
    from dflash.train.run import Run

    cfg = load_config(
        REPO / "configs" / "tiny-random.toml",
        [
            f"output_dir={tmp_path / 'run'}",
            f"checkpoint.dir={tmp_path / 'ck'}",
            "checkpoint.interval=0",
            "checkpoint.resume=never",
            "devices.drafters=cpu",
            "devices.targets=cpu",
            "max_steps=1",
        ],
    )
    assert Run(cfg, environ={}).train() == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": [3 + i, 40, 41, 42 + i]}) + "\n" for i in range(3)))
    eval_json, bench_json = tmp_path / "eval.json", tmp_path / "bench.json"
    ck = str(tmp_path / "ck")
    assert main(["eval", "--drafter", ck, "--prompts", str(prompts), "--max-new", "8", "--json", str(eval_json)]) == 0
    with EngineDouble("vllm") as engine:
        args = ["bench", "serve", "--server", engine.url, "--prompts", str(prompts), "--concurrency", "1"]
        assert main([*args, "--drafter", ck, "--max-new", "8", "--json", str(bench_json)]) == 0
    offline = json.loads(bench_json.read_text())["offline"]
    evaluated = json.loads(eval_json.read_text())
    assert offline["tau"] == evaluated["tau"] and offline["position_acceptance"] == evaluated["position_acceptance"]
    assert offline["same_prompts"] is True and offline["source"] == f"computed: dflash eval --drafter {ck}"


def test_exposition_text_is_read_as_prometheus_writes_it() -> None:
    text = (
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.\n"
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="a \\"b\\", c}"} 4.0\n'
        'vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 6.0\n'
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e+09\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 6.0\n'
        'vllm:num_requests_running{engine="0"} 2.0 1700000000000\n'
    )
    samples = engine_metrics.parse(text)
    assert samples[0].labels == {"engine": "0", "model_name": 'a "b", c}'} and samples[-1].value == 2.0
    r = engine_metrics.read(text)
    assert r.engine == "vllm" and r.drafts == 10.0 and r.accepted == 15.0 and r.per_position == (9.0, 6.0)
    a = engine_metrics.acceptance(engine_metrics.Reading("vllm"), r)
    assert a.length == 2.5 and a.per_position == (0.9, 0.6)
    with pytest.raises(engine_metrics.MetricsError, match="^line 2: x: 'fast' is not a number$"):
        engine_metrics.parse("# ok\nx fast\n")
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5 and percentile([1.0], 99) == 1.0


# ---- a server whose /metrics or answers cannot be trusted ---------------------------------------------


def test_a_trickling_metrics_is_given_up_at_a_whole_request_deadline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One byte a second: each read is quick, the whole never ends; --timeout 2 bounds the scrape."""
    prompts = chat_prompts(tmp_path / "p.jsonl", 2)
    with EngineDouble("vllm", metrics_drip=1.0) as engine:
        args = ["bench", "serve", "--server", engine.url, "--prompts", str(prompts), "--timeout", "2"]
        assert main(args) == 2
        assert engine.requests == []
    assert only_line(capsys) == f"bench serve: cannot read {engine.url}/metrics within 2s"


@pytest.mark.parametrize(("reset_at", "level"), [(10, 1), (4, 0)], ids=["counts-down", "counts-up-again"])
def test_counters_reset_during_a_level_give_no_acceptance_for_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], reset_at: int, level: int
) -> None:
    """The engine restarts at request ``reset_at`` (1 warm-up, then 5 per level): its counters start from 0.
    Either they end below where the level began, or above it with a new start time (``_created``)."""
    prompts = chat_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "bench.json"
    with EngineDouble("vllm", reset_at=reset_at) as engine:
        args = ["bench", "serve", "--server", engine.url, "--prompts", str(prompts), "--concurrency", "1,3"]
        assert main([*args, "--max-new", str(TOKENS), "--json", str(out)]) == 0
    levels = json.loads(out.read_text())["levels"]
    bad, good = levels[level], levels[1 - level]
    assert bad["acceptance_length"] is None and bad["accepted_tokens"] is None and bad["position_acceptance"] == []
    assert bad["acceptance_none"] == "the server's counters reset during the level"
    assert good["acceptance_length"] == VLLM_AL  # the other level is whole
    row = capsys.readouterr().out.splitlines()[3 + level]
    assert row.endswith("  none (the server's counters reset during the level)")


def test_a_counter_that_is_not_a_number_gives_no_acceptance_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = chat_prompts(tmp_path / "p.jsonl", 3)
    out = tmp_path / "bench.json"
    with EngineDouble("vllm", nan_at=3) as engine:  # from the second request of the first level on
        args = ["bench", "serve", "--server", engine.url, "--prompts", str(prompts), "--concurrency", "1,2"]
        assert main([*args, "--json", str(out)]) == 0
    levels = json.loads(out.read_text())["levels"]
    assert [lv["acceptance_length"] for lv in levels] == [None, None]
    assert {lv["acceptance_none"] for lv in levels} == {"a counter of the server is not a finite number"}
    assert "NaN" not in out.read_text()
    assert capsys.readouterr().out.splitlines()[3].endswith("none (a counter of the server is not a finite number)")


@pytest.mark.parametrize("tokens", [-1000, 10**30, 64])
def test_completion_tokens_outside_the_limit_are_a_server_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tokens: int
) -> None:
    prompts = chat_prompts(tmp_path / "p.jsonl", 2)
    with EngineDouble("vllm", completion_tokens=tokens) as engine:
        args = ["bench", "serve", "--server", engine.url, "--prompts", str(prompts), "--max-new", "8"]
        assert main(args) == 1
    assert only_line(capsys) == (
        f"bench serve: {engine.url}/v1/chat/completions: usage.completion_tokens {str(tokens)[:40]} is outside "
        "0..8 (the max_tokens asked for)"
    )


def _bench_child(server: str, prompts: Path) -> tuple[int, str, int]:
    """``dflash bench serve`` in a child under a 4 GiB address-space limit: (exit code, stderr, its peak RSS
    in KiB)."""
    import os
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    args = [sys.executable, "-m", "dflash", "bench", "serve", "--server", server, "--prompts", str(prompts)]
    child = subprocess.Popen(
        [*args, "--concurrency", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=limit, cwd=REPO
    )
    assert child.stderr is not None
    err = child.stderr.read().decode()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return child.returncode, err, usage.ru_maxrss


def test_a_huge_metrics_is_streamed_keeping_only_the_lines_used(tmp_path: Path) -> None:
    """100 MiB of other series before vLLM's: the scrape keeps the few spec-decoding lines (it cost 1.9 GB
    of RSS when the answer was read whole)."""
    prompts = chat_prompts(tmp_path / "p.jsonl", 1)
    with EngineDouble("vllm") as engine:
        code, err, plain = _bench_child(engine.url, prompts)
        assert code == 0, err
    with EngineDouble("vllm", metrics_padding=100 << 20) as engine:
        code, err, padded = _bench_child(engine.url, prompts)
        assert code == 0, err
        assert engine.metrics_requests >= 5  # the probe, then each level's settled readings before and after
    assert padded < plain + (32 << 10), (plain, padded)  # KiB: less than a third of the answer's size more


def test_sglang_counters_gone_after_a_restart_are_a_reset_not_an_older_build() -> None:
    before = engine_metrics.Reading("sglang", verify_calls=40.0, generation_tokens=105.0)
    after = engine_metrics.Reading("sglang", accept_length=2.5)  # the counters' children not made again yet
    a = engine_metrics.acceptance(before, after)
    assert a.length is None and a.why == "the server's counters reset during the level"


@pytest.mark.parametrize(
    ("miscount", "said"),
    [
        ("accepted", r"\d+ tokens accepted of \d+ drafted"),
        ("positions", r"position 1 accepted \d+ times in \d+ drafts \(225%\)"),
        ("sum", r"the positions sum to \d+ accepted tokens, the total says \d+"),
    ],
)
def test_counters_that_cannot_all_be_true_give_no_acceptance(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], miscount: str, said: str
) -> None:
    """More tokens accepted than drafted (an acceptance of 7 from 3-token drafts), a position accepted in
    more drafts than there were (225%), positions that do not sum to the accepted tokens: no figure, said."""
    import re

    prompts = chat_prompts(tmp_path / "p.jsonl")
    out = tmp_path / "bench.json"
    with EngineDouble("vllm", miscount=miscount) as engine:
        args = ["bench", "serve", "--server", engine.url, "--prompts", str(prompts), "--concurrency", "1"]
        assert main([*args, "--max-new", str(TOKENS), "--json", str(out)]) == 0
    (level,) = json.loads(out.read_text())["levels"]
    assert level["acceptance_length"] is None and level["position_acceptance"] == [], level
    assert re.fullmatch(f"inconsistent counters: {said}", level["acceptance_none"]), level["acceptance_none"]
    row = capsys.readouterr().out.splitlines()[3]
    assert re.search(rf"  none \(inconsistent counters: {said}\)$", row), row
