"""Compare two lm-eval runs of the parity tasks, sample by sample: `ember serve` through
`local-completions` against transformers through lm-eval's `hf` backend, same model, float32.

Tolerances (both sides compute in float32 on the CPU, through different kernels that sum in
different orders: SmolLM2's loglikelihoods differed by at most 5e-5 nats, a random model's larger
ones by ~1e-6 of their size). A loglikelihood `ll` agrees when the two are within
LOGLIKELIHOOD_ATOL + LOGLIKELIHOOD_RTOL * |ll| nats.
- multiple_choice: every choice's loglikelihood agrees. Then a document's pick can only differ
  where the hf scores of its best and another choice are within the sum of their tolerances (a
  float tie); `acc` / `acc_norm` may differ by at most those ties over the documents, so by 0
  when there are none.
- generate_until: every response identical (greedy decoding of the same weights; they part only
  where two logits are within float noise), so `exact_match` must be equal.
- loglikelihood_rolling: every document's loglikelihood agrees; perplexities and bits per byte
  within PERPLEXITY_REL_TOL of each other, relatively.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

LOGLIKELIHOOD_ATOL = 1e-3
LOGLIKELIHOOD_RTOL = 1e-5
PERPLEXITY_REL_TOL = 1e-4


@dataclass(frozen=True)
class MetricCheck:
    task: str
    metric: str
    ember: float
    hf: float
    allowed: float
    ok: bool


@dataclass(frozen=True)
class Run:
    """One lm-eval run: its results file, and each task's samples by document id."""

    results_path: Path
    results: dict
    samples: dict[str, dict[int, dict]]


def load_run(output_path: Path) -> Run:
    """The one results_*.json under `output_path` and its samples_<task>_*.jsonl."""
    (results_path,) = sorted(output_path.rglob("results_*.json"))
    samples = {}
    for task in json.loads(results_path.read_text())["results"]:
        (path,) = sorted(results_path.parent.glob(f"samples_{task}_*.jsonl"))
        docs = (json.loads(line) for line in path.read_text().splitlines() if line)
        samples[task] = {doc["doc_id"]: doc for doc in docs}
    return Run(results_path, json.loads(results_path.read_text()), samples)


def compare(ember: Run, hf: Run) -> dict:
    """Every task of the two runs, checked; `ok` is whether all checks pass."""
    tasks, checks = {}, []
    for task, config in sorted(hf.results["configs"].items()):
        output_type = config["output_type"]
        compare_samples = _SAMPLES[output_type]
        detail, allowed = compare_samples(ember.samples[task], hf.samples[task])
        for key, hf_value in sorted(hf.results["results"][task].items()):
            if "_stderr" in key or not isinstance(hf_value, float):
                continue
            metric = key.split(",")[0]
            ember_value = ember.results["results"][task][key]
            bound = allowed(metric, hf_value)
            ok = abs(ember_value - hf_value) <= bound
            checks.append(MetricCheck(task, metric, ember_value, hf_value, bound, ok))
        tasks[task] = {"output_type": output_type, "documents": len(hf.samples[task]), **detail}
    ok = all(c.ok for c in checks) and all(t["samples_ok"] for t in tasks.values())
    return {"ok": ok, "metrics": [asdict(c) for c in checks], "tasks": tasks}


def _multiple_choice(ember: dict[int, dict], hf: dict[int, dict]):
    worst, outside, ties, differing = 0.0, [], {"acc": [], "acc_norm": []}, {}
    for doc_id, hf_doc in sorted(hf.items()):
        hf_lls = [float(resp[0]) for resp in hf_doc["filtered_resps"]]
        ember_lls = [float(resp[0]) for resp in ember[doc_id]["filtered_resps"]]
        worst = max(worst, *(abs(a - b) for a, b in zip(ember_lls, hf_lls, strict=True)))
        if not all(map(_agree, ember_lls, hf_lls)):
            outside.append(doc_id)
        tolerances = [_tolerance(ll) for ll in hf_lls]
        lengths = [float(len(choice)) for choice in hf_doc["doc"]["choices"]]
        if _could_flip(hf_lls, tolerances):
            ties["acc"].append(doc_id)
        if _could_flip(
            [ll / n for ll, n in zip(hf_lls, lengths, strict=True)],
            [tol / n for tol, n in zip(tolerances, lengths, strict=True)],
        ):
            ties["acc_norm"].append(doc_id)
        for metric in ("acc", "acc_norm"):
            if hf_doc.get(metric) != ember[doc_id].get(metric):
                differing.setdefault(metric, []).append(doc_id)
    detail = {
        "max_abs_loglikelihood_diff": worst,
        "documents_outside_tolerance": outside,
        "near_ties": ties,
        "differing_picks": differing,
        "samples_ok": not outside and set(ember) == set(hf),
    }
    n = len(hf)
    return detail, lambda metric, _: len(ties.get(metric, [])) / n


def _tolerance(ll: float) -> float:
    return LOGLIKELIHOOD_ATOL + LOGLIKELIHOOD_RTOL * abs(ll)


def _agree(ember_ll: float, hf_ll: float) -> bool:
    return abs(ember_ll - hf_ll) <= _tolerance(hf_ll)


def _could_flip(scores: list[float], tolerances: list[float]) -> bool:
    """Whether moving each score by at most its tolerance could change the argmax."""
    best = max(range(len(scores)), key=scores.__getitem__)
    return any(
        scores[best] - scores[j] <= tolerances[best] + tolerances[j]
        for j in range(len(scores))
        if j != best
    )


def _generate_until(ember: dict[int, dict], hf: dict[int, dict]):
    differing = [
        {"doc_id": doc_id, "ember": ember[doc_id]["resps"], "hf": hf_doc["resps"]}
        for doc_id, hf_doc in sorted(hf.items())
        if ember[doc_id]["resps"] != hf_doc["resps"]
    ]
    detail = {
        "identical_responses": len(hf) - len(differing),
        "differing_responses": differing,
        "samples_ok": not differing and set(ember) == set(hf),
    }
    return detail, lambda metric, _: 0.0


def _loglikelihood_rolling(ember: dict[int, dict], hf: dict[int, dict]):
    pairs = {
        doc_id: (float(ember[doc_id]["resps"][0][0]), float(hf_doc["resps"][0][0]))
        for doc_id, hf_doc in hf.items()
    }
    outside = sorted(doc_id for doc_id, pair in pairs.items() if not _agree(*pair))
    detail = {
        "max_abs_loglikelihood_diff": max(abs(a - b) for a, b in pairs.values()),
        "documents_outside_tolerance": outside,
        "samples_ok": not outside and set(ember) == set(hf),
    }
    return detail, lambda metric, hf_value: PERPLEXITY_REL_TOL * abs(hf_value)


_SAMPLES = {
    "multiple_choice": _multiple_choice,
    "generate_until": _generate_until,
    "loglikelihood_rolling": _loglikelihood_rolling,
}


def markdown_table(reports: dict[str, dict]) -> str:
    """One row per metric: each ember run's value beside hf's, then how each run's samples
    compared."""
    names = list(reports)
    rows = [
        f"| task | metric | {' | '.join(names)} | hf | largest diff | allowed | ok |",
        "|" + " --- |" * (len(names) + 6),
    ]
    for checks in zip(*(reports[name]["metrics"] for name in names), strict=True):
        first = checks[0]
        values = " | ".join(f"{c['ember']:.6g}" for c in checks)
        diff = max(abs(c["ember"] - c["hf"]) for c in checks)
        ok = "yes" if all(c["ok"] for c in checks) else "NO"
        rows.append(
            f"| {first['task']} | {first['metric']} | {values} | {first['hf']:.6g} "
            f"| {diff:.2g} | {first['allowed']:.2g} | {ok} |"
        )
    rows.append("")
    for name, report in reports.items():
        for task, detail in report["tasks"].items():
            if "max_abs_loglikelihood_diff" in detail:
                how = f"largest loglikelihood difference {detail['max_abs_loglikelihood_diff']:.2g}"
            else:
                how = f"{detail['identical_responses']}/{detail['documents']} responses identical"
            agree = "agree" if detail["samples_ok"] else "DIFFER"
            rows.append(f"- {name} vs hf, {task}: samples {agree} ({how})")
    return "\n".join(rows)
