"""lm-evaluation-harness parity: the same local tasks through `ember serve` (lm-eval's
`local-completions`) and through transformers (lm-eval's `hf`), same model, float32 on the CPU;
the two compared sample by sample (compare.py states the tolerances). Exit 1 if they differ.

Run by tools/lm_eval_parity.sh inside its virtual environment (lm-eval, transformers, ember from
this checkout); see docs/lm_eval_parity.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import compare
import make_model

TASKS = ("ember_parity_mc", "ember_parity_gen", "ember_parity_ppl")
MAX_MODEL_LEN = 2048
SERVER_START_TIMEOUT_S = 300


def main() -> int:
    args = parse_args()
    repo, work = args.repo.resolve(), args.work.resolve()
    run_dir = work / "runs" / datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir.mkdir(parents=True)
    os.chdir(repo)  # the task YAMLs name their data files from the repository root

    started = time.perf_counter()
    model_dir = make_model.build(args.model, work / "models" / args.model)
    seconds = {"model": time.perf_counter() - started}
    print(f"model {args.model}: {model_dir} ({seconds['model']:.1f} s)", flush=True)

    serve, commands = command_lines(args, model_dir, free_port(), run_dir)
    with ember_server(serve, run_dir / "ember_serve.log") as server_seconds:
        seconds["ember_start"] = server_seconds
        for name in EMBER_RUNS:
            seconds[name] = run_logged(commands[name], run_dir / f"lm_eval_{name}.log")
    seconds["hf"] = run_logged(commands["hf"], run_dir / "lm_eval_hf.log")

    runs = {name: compare.load_run(run_dir / name) for name in commands}
    reports = {name: compare.compare(runs[name], runs["hf"]) for name in EMBER_RUNS}
    ok = all(report["ok"] for report in reports.values())
    table = compare.markdown_table(reports)
    print(table)
    summary = {
        "benchmark": "lm_eval_parity",
        "ok": ok,
        "model": args.model,
        "command": shlex.join(["tools/lm_eval_parity.sh", *user_arguments(sys.argv[1:])]),
        "commit": commit(repo),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "tolerances": {
            "loglikelihood_atol_nats": compare.LOGLIKELIHOOD_ATOL,
            "loglikelihood_rtol": compare.LOGLIKELIHOOD_RTOL,
            "perplexity_relative": compare.PERPLEXITY_REL_TOL,
            "rule": compare.__doc__.split("\n\n", 1)[1],
        },
        "commands": {"ember_serve": shlex.join(serve)}
        | {f"lm_eval_{name}": shlex.join(command) for name, command in commands.items()},
        "seconds": {name: round(value, 1) for name, value in seconds.items()},
        "comparisons": {f"{name} vs hf": report for name, report in reports.items()},
        "table": table,
        "run_dir": str(run_dir),
    }
    write_results(args.out, args.model, summary, runs)
    verdict = "agree within" if ok else "differ beyond"
    print(
        f"\n{'PASS' if ok else 'FAIL'}: ember serve and transformers {verdict} the tolerances "
        "(tools/lm_eval_parity/compare.py)"
    )
    return 0 if ok else 1


# Two ways lm-eval talks to a server, each a `local-completions` run: token ids from the model's
# own tokenizer files; and the server's tokenizer (lm-eval's default tokenizer_backend=auto finds
# /tokenizer_info, then uses /tokenize and /detokenize), the prompts sent as text.
EMBER_RUNS = {
    "ember": "tokenizer={model_dir},tokenizer_backend=huggingface",
    "ember_remote_tokenizer": "tokenized_requests=False",
}


def command_lines(
    args: argparse.Namespace, model_dir: Path, port: int, run_dir: Path
) -> tuple[list[str], dict[str, list[str]]]:
    """`ember serve`'s command, and each lm-eval run's by name (EMBER_RUNS, then hf)."""
    served = f"parity-{args.model}"
    serve = [
        *("ember", "serve", str(model_dir), "--served-model-name", served),
        *f"--host 127.0.0.1 --port {port} --device cpu --dtype float32".split(),
        *f"--max-model-len {MAX_MODEL_LEN} --enable-tokenizer-info-endpoint".split(),
        "--disable-progress-bar",
        "--disable-uvicorn-access-log",
    ]
    common = [
        *f"--tasks {','.join(args.tasks)} --batch_size {args.batch_size} --seed 0".split(),
        *("--include_path", "tools/lm_eval_parity/tasks", "--log_samples"),
        *(("--limit", str(args.limit)) if args.limit else ()),
    ]
    server = (
        f"model={served},base_url=http://127.0.0.1:{port}/v1/completions,max_length="
        f"{MAX_MODEL_LEN},num_concurrent={args.num_concurrent},max_retries=1,timeout=600"
    )
    commands = {
        name: ["lm_eval", "--model", "local-completions", "--model_args"]
        + [f"{server},{extra.format(model_dir=model_dir)}", *common]
        + ["--output_path", str(run_dir / name)]
        for name, extra in EMBER_RUNS.items()
    }
    commands["hf"] = [
        *("lm_eval", "--model", "hf", "--model_args", f"pretrained={model_dir},dtype=float32"),
        *("--device", "cpu", *common, "--output_path", str(run_dir / "hf")),
    ]
    return serve, commands


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True, help="models and runs go here")
    parser.add_argument("--model", choices=make_model.MODELS, default="smollm2")
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--limit", type=int, default=None, help="documents per task (a smoke run)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts per request / hf batch")
    parser.add_argument("--num-concurrent", type=int, default=2, help="requests in flight")
    parser.add_argument(
        "--out", type=Path, default=Path("bench/results"), help="where the results are written"
    )
    return parser.parse_args()


def user_arguments(argv: list[str]) -> list[str]:
    """The arguments given to tools/lm_eval_parity.sh: argv less the --repo and --work it adds."""
    kept, skip = [], False
    for arg in argv:
        if skip or arg in ("--repo", "--work"):
            skip = not skip
            continue
        kept.append(arg)
    return kept


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ember_server:
    """`ember serve` in its own process group for the `with` block; yields its start seconds."""

    def __init__(self, command: list[str], log_path: Path) -> None:
        self.command, self.log_path = command, log_path

    def __enter__(self) -> float:
        print(f"$ {shlex.join(self.command)}", flush=True)
        started = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        port = self.command[self.command.index("--port") + 1]
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._fail(f"ember serve exited ({self.process.returncode})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - started
            except OSError:
                pass
            time.sleep(0.2)
        self._fail(f"ember serve not healthy after {SERVER_START_TIMEOUT_S} s")

    def __exit__(self, *exc) -> None:
        # SIGTERM drains and ends both processes; what is left after 60 s is killed.
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def _fail(self, why: str) -> None:
        self.__exit__()
        tail = self.log_path.read_text(errors="replace")[-4000:]
        raise SystemExit(f"{why}; its log ({self.log_path}) ends:\n{tail}")


def run_logged(command: list[str], log_path: Path) -> float:
    """Run `command` with its output in `log_path` (and its last lines printed); seconds taken."""
    print(f"$ {shlex.join(command)}", flush=True)
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    lines = log_path.read_text(errors="replace").splitlines()
    if code != 0:
        tail = "\n".join(lines[-40:])
        raise SystemExit(f"{command[0]} failed ({code}); its log ({log_path}) ends:\n{tail}")
    print("\n".join(line for line in lines[-12:] if line.startswith("|")), flush=True)
    return time.perf_counter() - started


def commit(repo: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, check=False
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    return f"{head} + uncommitted changes" if git("status", "--porcelain") else head


def machine() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    memory_kib = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(memory_kib / 2**20, 1),
        "platform": platform.platform(),
    }


def versions() -> dict:
    from importlib.metadata import version

    packages = ("lm_eval", "transformers", "torch", "tokenizers", "datasets", "ember")
    return {"python": platform.python_version(), **{p: version(p) for p in packages}}


def write_results(out: Path, model: str, summary: dict, runs: dict[str, compare.Run]) -> None:
    """The summary, and each run's lm-eval results file beside it."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"cpu_lm_eval_parity_{model}"
    for name, run in runs.items():
        shutil.copy(run.results_path, out / f"{stem}_{name}.json")
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / stem}.json and {stem}_{{{','.join(runs)}}}.json", flush=True)


if __name__ == "__main__":
    sys.exit(main())
