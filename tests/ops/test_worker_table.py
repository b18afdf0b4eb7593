"""`dflashctl status` shows the workers of the last metrics.jsonl record (probe is pure).

RECORD is a real last record: the pipeline with the bench's simulated workers, 5 targets on 3 round-robin
(per-drafter) queues = [2, 2, 1], the seed's night in small: drafter-2 starved, the targets of the other two
blocked. (Devices are labels there: the simulated workers sleep.)
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from ops import probe

FACTS = Path(__file__).parent / "facts"

RECORD = json.loads("""
{"step": 180, "loss": 0.491593, "acc": 0.918068, "tau_tf": 3.754203, "ktok_s": 183.0046, "tokens": 245760, "steps": 60,
 "interval_s": 1.3429, "lr": 0.0, "queue_depth": 4, "queue_capacity": 6, "drafters_live": 3, "drafters_total": 3,
 "targets_live": 5, "targets_total": 5, "acc_per_slot": [], "workers": [
 {"name": "target-0", "role": "target", "index": 0, "device": "cuda:0", "alive": true, "dead": false, "busy": 0.6575, "wait": 0.3425, "barrier": 0.0, "other": 0.0, "batches": 11, "batches_s": 8.1911, "items": 34, "clock": "host", "error": null},
 {"name": "target-1", "role": "target", "index": 1, "device": "cuda:1", "alive": true, "dead": false, "busy": 0.657, "wait": 0.343, "barrier": 0.0, "other": 0.0, "batches": 11, "batches_s": 8.1911, "items": 34, "clock": "host", "error": null},
 {"name": "target-2", "role": "target", "index": 2, "device": "cuda:2", "alive": true, "dead": false, "busy": 0.9989, "wait": 0.0011, "barrier": 0.0, "other": 0.0, "batches": 16, "batches_s": 11.9144, "items": 50, "clock": "host", "error": null},
 {"name": "target-3", "role": "target", "index": 3, "device": "cuda:3", "alive": true, "dead": false, "busy": 0.6122, "wait": 0.3878, "barrier": 0.0, "other": 0.0, "batches": 10, "batches_s": 7.4465, "items": 33, "clock": "host", "error": null},
 {"name": "target-4", "role": "target", "index": 4, "device": "cuda:4", "alive": true, "dead": false, "busy": 0.612, "wait": 0.388, "barrier": 0.0, "other": 0.0, "batches": 10, "batches_s": 7.4465, "items": 33, "clock": "host", "error": null},
 {"name": "drafter-0", "role": "drafter", "index": 0, "device": "cuda:5", "alive": true, "dead": false, "busy": 0.9435, "wait": 0.0008, "barrier": 0.0, "other": 0.0557, "batches": 21, "batches_s": 15.6376, "items": 65, "clock": "host", "error": null},
 {"name": "drafter-1", "role": "drafter", "index": 1, "device": "cuda:6", "alive": true, "dead": false, "busy": 0.9433, "wait": 0.0014, "barrier": 0.0, "other": 0.0553, "batches": 22, "batches_s": 16.3822, "items": 65, "clock": "host", "error": null},
 {"name": "drafter-2", "role": "drafter", "index": 2, "device": "cuda:7", "alive": true, "dead": false, "busy": 0.7589, "wait": 0.2403, "barrier": 0.0, "other": 0.0008, "batches": 17, "batches_s": 12.659, "items": 50, "clock": "host", "error": null}],
 "at": "2026-11-30T10:54:25Z"}
""")


def running_facts() -> dict:
    facts = copy.deepcopy(json.loads((FACTS / "running.json").read_text())["facts"])
    facts["agent"]["attempt"]["metrics"]["last"] = copy.deepcopy(RECORD)
    return facts


def test_status_shows_the_worker_table_under_the_headline_and_json_carries_it() -> None:
    facts = running_facts()
    facts["agent"]["gpus"] = [
        {
            "index": 7,
            "name": "NVIDIA H200",
            "memory_used_mib": 61234.0,
            "memory_total_mib": 143771.0,
            "utilization_pct": 71.0,
        }
    ]
    st = probe.classify(facts)
    assert st.state == "running"
    lines = st.lines()
    assert lines[0] == st.headline()
    assert lines[1] == "  workers:   at step 180"
    table = lines[2:11]
    assert table[0].split() == ["worker", "device", "busy", "waiting", "batch/s", "gpu"]
    rows = {ln.split()[0]: ln for ln in table[1:]}
    assert rows["drafter-2"].split() == [
        "drafter-2",
        "cuda:7",
        "76%",
        "24%",
        "starved",
        "12.7",
        "71%",
        "util,",
        "61234/143771",
        "MiB",
    ]
    assert rows["drafter-0"].split() == ["drafter-0", "cuda:5", "94%", "0%", "starved", "15.6"]
    assert rows["target-3"].split() == ["target-3", "cuda:3", "61%", "39%", "blocked", "7.4"]
    assert rows["target-2"].split() == ["target-2", "cuda:2", "100%", "0%", "blocked", "11.9"]
    got = st.to_json()
    assert json.loads(json.dumps(got)) == got
    w = {x["name"]: x for x in got["workers"]}
    assert len(w) == 8 and w["drafter-2"]["busy"] == 0.7589 and w["drafter-2"]["wait"] == 0.2403
    assert (w["drafter-2"]["gpu_util_pct"], w["drafter-2"]["gpu_memory_used_mib"]) == (71.0, 61234.0)
    assert w["target-0"]["gpu_util_pct"] is None  # nvidia-smi said nothing about GPU 0


def test_without_workers_in_the_record_there_is_no_table_and_the_key_is_null() -> None:
    facts = running_facts()
    del facts["agent"]["attempt"]["metrics"]["last"]["workers"]
    st = probe.classify(facts)
    assert st.to_json()["workers"] is None
    assert not any("workers:" in ln for ln in st.lines())
    facts["agent"]["attempt"]["metrics"] = None  # no metrics.jsonl at all
    assert probe.classify(facts).to_json()["workers"] is None


def test_a_dead_worker_is_marked() -> None:
    facts = running_facts()
    rec = facts["agent"]["attempt"]["metrics"]["last"]
    rec["workers"][7].update(dead=True, alive=False, busy=0.0, wait=0.0, batches_s=0.0)
    row = next(ln for ln in probe.classify(facts).lines() if ln.split()[:1] == ["drafter-2"])
    assert row.endswith("(dead)") and "  0%" in row
