"""The ``icefloe`` command line: one function per command on one typer app.

Heavy modules (torch, the engines, the recipes) are imported inside the commands, so importing
this module, or running ``icefloe --help``, stays light.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import itertools
import json
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from icefloe.recipes.grpo import GRPOConfig

__all__ = ["app", "main", "run_demo"]

app = typer.Typer(
    name="icefloe",
    help="A training-and-sampling backend for LLM reinforcement learning.",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # subcommands inherit it
)
console = Console()

SUMMARY_WINDOW = 10  # steps averaged for the start and end rewards of the demo's summary line


def _print_version(wanted: bool) -> None:
    if wanted:
        typer.echo(f"icefloe {importlib.metadata.version('icefloe')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Keep subcommands explicit: ``icefloe demo``, never a bare ``icefloe`` that runs one."""


@app.command()
def demo(
    steps: Annotated[int | None, typer.Option(min=1, help="GRPO steps after the warm-up (default: 200).")] = None,
    seed: Annotated[int, typer.Option(help="Seeds the model, the problems and the sampler.")] = 0,
    name: Annotated[
        str, typer.Option(help="Run name: results go to OUT_DIR/NAME/, or NAME-2, NAME-3, ... once it holds a run.")
    ] = "demo",
    backend: Annotated[
        str,
        typer.Option(
            help="local (engines in this process), ray (Ray actors; a local Ray unless one runs) "
            "or remote (ICEFLOE_REMOTE_*, else a local serve)."
        ),
    ] = "local",
    out_dir: Annotated[Path, typer.Option(help="Parent folder of run folders.")] = Path("runs"),
    lora_rank: Annotated[
        int, typer.Option(min=0, help="Train LoRA adapters of this rank in RL (0 = the full weights).")
    ] = 0,
    tracker: Annotated[
        list[str] | None,
        typer.Option(
            help="Where per-step metrics go: jsonl, tensorboard, wandb (offline unless WANDB_MODE), mlflow. "
            "Repeatable or comma-separated (default: jsonl)."
        ),
    ] = None,
) -> None:
    """Teach a tiny model addition with GRPO and print how its reward rose."""
    from icefloe.protocol import ConfigError, IcefloeError
    from icefloe.recipes.trackers import require_trackers

    if backend not in ("local", "ray", "remote"):
        raise typer.BadParameter(f"must be local, ray or remote; got {backend!r}", param_hint="--backend")
    trackers = [name.strip() for names in tracker or ["jsonl"] for name in names.split(",") if name.strip()]
    try:
        require_trackers(trackers)
    except (ImportError, ValueError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--tracker") from None
    try:
        run_demo(
            steps=steps, seed=seed, name=name, backend=backend, out_dir=out_dir, lora_rank=lora_rank, trackers=trackers
        )
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    except IcefloeError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def run_demo(
    *,
    steps: int | None = None,
    seed: int = 0,
    name: str = "demo",
    backend: str = "local",
    out_dir: Path = Path("runs"),
    lora_rank: int = 0,
    trackers: Sequence[str] = ("jsonl",),
) -> list[dict[str, Any]]:
    """Run the GRPO recipe with a progress bar and print one summary line; returns the metric rows.

    The run goes to ``out_dir/name``, or to the first of ``name-2``, ``name-3``, ... that holds no run,
    so a second demo (or one after a failed run) never overwrites or refuses. The summary's start
    reward is the mean of the first 10 RL steps, its end the mean of the last 10.
    """
    from icefloe.recipes.grpo import GRPOConfig

    name = _fresh_name(out_dir, name)
    _quiet_transformers()
    with _demo_backend(backend) as base_url:
        config = GRPOConfig(
            name=name,
            out_dir=out_dir,
            seed=seed,
            **({} if steps is None else {"steps": steps}),
            backend=backend,
            base_url=base_url,
            lora_rank=lora_rank,
            trackers=list(trackers),
        )
        warm_up = (
            f"a {config.warmup_steps}-step supervised warm-up (cross-entropy on right answers) teaches the answer "
            "format first: from random weights the model never writes a right sum, so RL alone would see reward 0"
        )
        if lora_rank:
            # The demo adapts its tied output layer on purpose and never merges the adapter into it.
            warnings.filterwarnings("ignore", "Model has `tie_word_embeddings=True`", UserWarning)
            warm_up = (
                f"RL trains LoRA adapters only (rank {lora_rank}, on the attention, MLP and output layers), "
                f"after a {config.warmup_steps}-step full-weight supervised warm-up: adapters alone cannot teach "
                "the random tiny model the answer format"
            )
        console.print(f"demo: {warm_up}", highlight=False, soft_wrap=True)
        with _one_torch_thread() if backend == "local" else contextlib.nullcontext():  # Ray workers set their own
            return _run_demo(config)


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """The demo's in-process engines on one torch thread: the demo model is too small to share its
    matmuls between cores (one thread ran a full run in 47 s, two in 57 s, on 2 cores), and on one
    thread every machine computes the same curve whatever its core count."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _fresh_name(out_dir: Path, name: str) -> str:
    """``name``, or ``name-N`` for the smallest N >= 2 whose folder under ``out_dir`` is missing or empty."""
    for number in itertools.count(1):
        candidate = name if number == 1 else f"{name}-{number}"
        folder = out_dir / candidate
        if not (folder.is_dir() and any(folder.iterdir())):
            return candidate
    raise AssertionError("unreachable: count() never ends")


@contextlib.contextmanager
def _demo_backend(backend: str) -> Iterator[str | None]:
    """For ``--backend remote`` with no service configured, a local ``icefloe serve`` on a free port.

    For ``--backend ray``, the running cluster ``RAY_ADDRESS`` or ``ray start`` names, else a local Ray
    of 2 logical CPUs (one per demo worker, whatever the machine has); left (or shut down) at the end.
    """
    from icefloe.config import ClientConfig

    if backend == "ray":
        import ray

        if ray.is_initialized():
            yield None
            return
        options = {"include_dashboard": False, "log_to_driver": False, "namespace": "icefloe"}
        # Not address="auto": that joins any Ray running on the machine, another program's included.
        try:
            ray.init(num_cpus=2, **options)
            console.print("demo: started a local Ray with 2 CPUs", highlight=False)
        except ValueError as exc:  # RAY_ADDRESS or `ray start` names a cluster: joined as it is (no num_cpus)
            if "existing cluster" not in str(exc):
                raise
            ray.init(**options)
            console.print(f"demo: joined the Ray cluster at {ray.get_runtime_context().gcs_address}", highlight=False)
        try:
            yield None
        finally:
            ray.shutdown()
        return
    configured = ClientConfig.from_env(backend={"type": "remote"}).backend if backend == "remote" else None
    if configured is None or configured.base_url or configured.host:
        yield None
        return
    from icefloe.service.app import ServerThread, create_app
    from icefloe.service.settings import ServeSettings

    with contextlib.ExitStack() as stack:
        data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="icefloe-demo-serve-"))
        base_url = stack.enter_context(ServerThread(create_app(ServeSettings(data_dir=Path(data_dir), port=0))))
        console.print(f"demo: started icefloe serve at {base_url} (data in {data_dir})", highlight=False)
        yield base_url


def _run_demo(config: GRPOConfig) -> list[dict[str, Any]]:
    import asyncio

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from icefloe.recipes.grpo import run, summarize

    name, out_dir, seed, steps = config.name, config.out_dir, config.seed, config.steps
    started = time.perf_counter()
    columns = (
        TextColumn("[bold]GRPO[/] {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("reward {task.fields[reward]:.2f}  loss {task.fields[loss]:+.3f}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task(f"{config.model} seed {seed}", total=steps, reward=0.0, loss=0.0)

        def advance(row: dict[str, Any]) -> None:
            progress.update(bar, advance=1, reward=row["reward"], loss=row["loss"])

        history = asyncio.run(run(config, on_step=advance))
    seconds = time.perf_counter() - started
    start, end = summarize(history, window=SUMMARY_WINDOW)
    console.print(
        f"demo: reward {start:.2f} → {end:.2f} over {len(history)} steps in {seconds:.1f} s "
        f"({out_dir / name}: {', '.join(config.trackers)})",
        highlight=False,
        soft_wrap=True,  # one line at any terminal width, so scripts can grep it
    )
    return history


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="Interface to bind; loopback unless you mean to expose it.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="A free TCP port.")] = 8321,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            help="Where job records, logs, results and checkpoints live (default: serve/ in the user data "
            "directory, ~/.local/share/icefloe/serve on Linux).",
            show_default=False,
        ),
    ] = None,
    token: Annotated[
        list[str] | None,
        typer.Option(help="Bearer token callers must send (repeatable). Shows in `ps`: prefer --token-file."),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            help="File of bearer tokens, one per line (recommended; or set ICEFLOE_SERVE_TOKENS). A line "
            "'name: token' gives the token to tenant 'name' (each tenant sees only its own work; 'admin' sees all), "
            "optionally followed by its limits: max_jobs=N max_lora_adapters=N max_slots=N."
        ),
    ] = None,
    model_root: Annotated[
        Path | None,
        typer.Option(help="Folder of model folders jobs may load (model_name org/name); default: tiny:* presets only."),
    ] = None,
    slots: Annotated[int, typer.Option(min=1, help="CPU slots to hand out when there is no GPU.")] = 4,
    max_adapters: Annotated[
        int,
        typer.Option(min=1, help="LoRA jobs of one base model share a host and a slot; at most this many per host."),
    ] = 32,
    engines: Annotated[
        str,
        typer.Option(help="Where engines run: process (a child process per host), local (this process) or ray."),
    ] = "process",
    address: Annotated[
        str | None, typer.Option(help="With --engines ray: the Ray cluster to join ('auto' = the running one).")
    ] = None,
    lease_ttl_s: Annotated[
        float, typer.Option(min=0, help="Cancel a job its client has not renewed for this long (0 = never).")
    ] = 600.0,
    op_deadline_s: Annotated[
        float,
        typer.Option(
            min=0.001,
            help="An op running longer stops at its next pass or decode step and fails its own job only; "
            "its engine process is killed only if it does not stop.",
        ),
    ] = 3600.0,
    metrics_public: Annotated[
        bool, typer.Option(help="Answer GET /metrics (Prometheus) without the token (a scraper on a trusted network).")
    ] = False,
    sequence_gap_timeout_s: Annotated[
        float,
        typer.Option(
            min=0.001, help="A numbered call (Icefloe-Sequence, Tinker seq_id) waits this long for a missing one."
        ),
    ] = 30.0,
    sequence_window: Annotated[
        int,
        typer.Option(
            min=1, help="Refuse a numbered call (Icefloe-Sequence, Tinker seq_id) this far past the next one expected."
        ),
    ] = 10_000,
    public_url: Annotated[
        str | None,
        typer.Option(
            help="The service's URL as callers reach it (a proxy in front): download links are made on it, an https "
            "URL makes the login cookie Secure, and without tokens its host is answered beside the bound address."
        ),
    ] = None,
    forwarded_allow_ips: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated proxy addresses or networks ('*': any) whose X-Forwarded-For/-Proto are believed; "
            "default: none, so a client's address (for the failed-token limit) is its connection's."
        ),
    ] = None,
    header_timeout_s: Annotated[
        float, typer.Option(min=0.001, help="Close a connection whose request headers take longer (408).")
    ] = 20.0,
    body_timeout_s: Annotated[
        float,
        typer.Option(min=0.001, help="Close a connection whose body takes longer, plus 1 s per 8 KiB it delivers."),
    ] = 20.0,
    max_samples_per_request: Annotated[
        int, typer.Option(min=1, help="Tinker API: most samples one request may ask for (num_samples x prompts).")
    ] = 1024,
    max_tokens_per_request: Annotated[
        int,
        typer.Option(min=1, help="Tinker API: most tokens one request may hold or generate (datums, or samples)."),
    ] = 1_048_576,
    max_held_ahead_mb: Annotated[
        int,
        typer.Option(
            min=1,
            help="Tinker API: MiB of ops one tenant may have waiting for an earlier seq_id; past it, 429 (retried).",
        ),
    ] = 256,
    max_job_metric_values: Annotated[
        int,
        typer.Option(min=1, help="Values one job keeps of what its client reports (POST {job}/metrics); past it, 409."),
    ] = 250_000,
    max_stream_events_mb: Annotated[
        int,
        typer.Option(
            min=1,
            help="MiB of generate-stream events one tenant has not polled (drained); past it a new stream is 429 "
            "and a running one that does not fit fails its remaining prompts.",
        ),
    ] = 256,
    max_loaded_models: Annotated[
        int,
        typer.Option(
            min=1, help="OpenAI endpoint: models kept loaded at once; past it the least recently used idle one goes."
        ),
    ] = 16,
    loaded_model_idle_s: Annotated[
        float,
        typer.Option(min=0.001, help="OpenAI endpoint: unload a model no request used for this long (seconds)."),
    ] = 600.0,
) -> None:
    """Run the training-API service (`icefloe serve`) that remote clients point their base URL at.

    Tokens: give them with --token-file or ICEFLOE_SERVE_TOKENS, not --token (`ps` shows it to every user).
    Clients send one: ICEFLOE_REMOTE_PAT, or --token on icefloe jobs | logs | checkpoints.
    """
    from icefloe.config import user_data_dir
    from icefloe.protocol import ConfigError
    from icefloe.service.app import base_url, listen
    from icefloe.service.app import serve as run_service
    from icefloe.service.settings import ServeSettings

    data_dir = (data_dir or user_data_dir() / "serve").expanduser().resolve()  # results name absolute paths
    try:
        settings = ServeSettings.from_env(
            data_dir=data_dir, host=host, port=port, tokens=token or [], token_file=token_file, slots=slots,
            max_adapters=max_adapters, engines=engines, ray_address=address, model_root=model_root,
            lease_ttl_s=lease_ttl_s, op_deadline_s=op_deadline_s, metrics_public=metrics_public, public_url=public_url,
            sequence_gap_timeout_s=sequence_gap_timeout_s, sequence_window=sequence_window,
            forwarded_allow_ips=forwarded_allow_ips or (),
            header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s,
            max_samples_per_request=max_samples_per_request, max_tokens_per_request=max_tokens_per_request,
            max_held_ahead_mb=max_held_ahead_mb, max_job_metric_values=max_job_metric_values,
            max_stream_events_mb=max_stream_events_mb,
            max_loaded_models=max_loaded_models, loaded_model_idle_s=loaded_model_idle_s,
        )  # fmt: skip
        if address is not None and settings.engines != "ray":
            raise ConfigError("--address names a Ray cluster; it needs --engines ray")
    except ConfigError as exc:
        raise typer.BadParameter(str(exc)) from None
    listening = listen(host, port)  # before the banner: a busy port is one line, not a banner then a traceback
    tenants = {tenant for _, tenant in settings.token_tenants()}
    auth = f"bearer auth on ({len(settings.token_values())} token(s), {len(tenants)} tenant(s))"
    auth = auth if settings.auth_enabled else "no auth"
    if not settings.auth_enabled and host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]warning: {host} is reachable from other machines and no --token is set[/yellow]")
    url = escape(base_url(host, port))
    console.print(f"icefloe serve: base URL [bold]{url}[/bold] ({auth}; data in {data_dir})")
    pat = " ICEFLOE_REMOTE_PAT=<one of the tokens>" if settings.auth_enabled else ""
    console.print(f"  remote clients: ICEFLOE_REMOTE_BASE_URL={url}{pat}", soft_wrap=True)
    if settings.engines == "ray":
        import ray

        ray.init(address=settings.ray_address, namespace="icefloe-serve", include_dashboard=False, log_to_driver=False)
        console.print(f"  engines: Ray actors on {ray.get_runtime_context().gcs_address}")
    run_service(settings, sock=listening)


jobs_app = typer.Typer(
    help="Jobs on a training-API service (icefloe serve or a managed endpoint).", no_args_is_help=True
)
app.add_typer(jobs_app, name="jobs")

BaseUrl = Annotated[
    str | None,
    typer.Option(
        "--base-url", help="The service, e.g. http://127.0.0.1:8321; default: ICEFLOE_REMOTE_* / ARCTIC_CORTEX_*."
    ),
]
Token = Annotated[
    str | None,
    typer.Option(
        "--token", help="Bearer token of the service (one of its serve --token values); default: ICEFLOE_REMOTE_PAT."
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON (for scripts) instead of a table.")]


@contextlib.contextmanager
def _admin(base_url: str | None, token: str | None) -> Iterator[Any]:
    """A ServiceAdmin for --base-url / --token, or for the remote settings in the environment."""
    from icefloe.client.remote.admin import ServiceAdmin
    from icefloe.config import ClientConfig
    from icefloe.protocol import ConfigError, IcefloeError

    explicit = {"base_url": base_url, "pat": token}
    try:
        backend = ClientConfig.from_env(backend={"type": "remote", **{k: v for k, v in explicit.items() if v}}).backend
        pat = backend.pat.get_secret_value() if backend.pat else ""
        if backend.host and not backend.base_url and not pat:  # the managed endpoint needs a token
            raise typer.BadParameter(f"no token for {backend.host}: pass --token TOKEN or set ICEFLOE_REMOTE_PAT")
        admin = ServiceAdmin(backend)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--base-url") from None
    try:
        with admin:
            yield admin
    except IcefloeError as exc:
        console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value, indent=2, default=str))


def _print_table(table: Any) -> None:
    """Print ``table`` with every cell whole: piped, at its natural width (one line per row); on a
    terminal, at least as wide as its no-wrap columns (IDs, URLs) need; other columns wrap."""
    from rich.measure import Measurement

    natural = Measurement.get(console, console.options.update_width(_UNBOUNDED), table)
    width = max(console.width, natural.minimum) if console.is_terminal else natural.maximum
    Console(width=width, highlight=False).print(table)


_UNBOUNDED = 1_000_000  # a width no table reaches, to measure its natural width


@jobs_app.command("list")
def jobs_list(
    base_url: BaseUrl = None,
    token: Token = None,
    status: Annotated[str | None, typer.Option(help="Only jobs in this state, e.g. running.")] = None,
    as_json: AsJson = False,
) -> None:
    """List jobs, newest first: id, state, sub-jobs and the reason (why it failed, or why it waits)."""
    from rich.table import Column, Table

    from icefloe.protocol import JOB_STATES, normalize_job_state

    if status is not None and normalize_job_state(status) not in JOB_STATES:
        states = ", ".join(sorted(JOB_STATES))
        raise typer.BadParameter(f"must be one of {states}; got {status!r}", param_hint="--status")
    with _admin(base_url, token) as admin:
        jobs = sorted(reversed(admin.list_jobs(status)), key=lambda job: str(job.get("created_at", "")), reverse=True)
    if as_json:
        _print_json(jobs)
        return
    table = Table(Column("job_id", no_wrap=True), "status", Column("created_at", no_wrap=True), "sub-jobs", "reason")
    for job in jobs:
        table.add_row(
            job.get("job_id", "?"), job.get("status", "?"), job.get("created_at", ""), _sub_jobs(job), job.get("reason")
        )
    _print_table(table)


def _sub_jobs(job: dict[str, Any]) -> str:
    return ", ".join(
        f"{s.get('sub_job_id', '?').split(':', 1)[-1]}={s.get('status', '?')}" for s in job.get("sub_jobs", [])
    )


@jobs_app.command("show")
def jobs_show(job_id: str, base_url: BaseUrl = None, token: Token = None, as_json: AsJson = False) -> None:
    """One job: state, model, current step and last loss, request queue, lease, sub-jobs, reason."""
    with _admin(base_url, token) as admin:
        job = admin.get_job(job_id)
        points = admin.job_metrics(job_id)
    last = points[-1] if points else {}
    loss = next((p["loss"] for p in reversed(points or []) if p.get("loss") is not None), None)
    if as_json:
        _print_json({**job, "last_metrics": last or None})
        return
    queue, lease = job.get("queue"), job.get("lease_expires_in_s")
    from icefloe.protocol import JOB_TERMINAL_STATES, normalize_job_state

    ended = normalize_job_state(str(job.get("status", ""))) in JOB_TERMINAL_STATES
    lines = {
        "job_id": job.get("job_id", job_id),
        "status": job.get("status", "?"),
        "created_at": job.get("created_at", ""),
        "model": ", ".join(sorted({s.get("model_name", "?") for s in job.get("sub_jobs", [])})) or "-",
        "step": last.get("step", "-"),
        "last loss": "-" if loss is None else f"{loss:.4f}",
        "queue": "-" if queue is None else f"{queue.get('pending', 0)} pending, {queue.get('running', 0)} running",
        "lease": "ended" if ended else "-" if lease is None else f"{lease:.0f} s left (renewed by its client's calls)",
        "sub-jobs": _sub_jobs(job) or "-",
        "reason": job.get("reason") or "-",
    }
    for name, value in lines.items():
        console.print(f"{name:<11} {value}", highlight=False, markup=False, soft_wrap=True)


@jobs_app.command("cancel")
def jobs_cancel(job_id: str, base_url: BaseUrl = None, token: Token = None) -> None:
    """Cancel a job and release its resources."""
    with _admin(base_url, token) as admin:
        admin.cancel_job(job_id)
        status = admin.get_job(job_id).get("status", "?")
    console.print(f"job {job_id}: {status}", highlight=False, soft_wrap=True)


@app.command()
def logs(
    job_id: str,
    base_url: BaseUrl = None,
    token: Token = None,
    sub_job: Annotated[str, typer.Option(help="Which role's log: training, sampling or log_probability.")] = "training",
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing until the job's log ends.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print each entry as one line of JSON.")] = False,
) -> None:
    """Print a job's structured log (the service's tail-logs operation)."""
    with _admin(base_url, token) as admin:
        for entry in admin.read_logs(job_id, sub_job_type=sub_job, follow=follow):
            if as_json:
                typer.echo(json.dumps(entry, default=str))
                continue
            text = entry.get("msg", entry.get("message", entry.get("_raw", "")))
            console.print(
                f"{entry.get('ts', '')} {entry.get('level', ''):<7} {text}",
                highlight=False,
                markup=False,
                soft_wrap=True,
            )


@app.command()
def checkpoints(
    job_id: str,
    base_url: BaseUrl = None,
    token: Token = None,
    export: Annotated[str | None, typer.Option(help="A checkpoint id: print its download URLs.")] = None,
    as_json: AsJson = False,
) -> None:
    """List a job's checkpoints, or print one checkpoint's download URLs."""
    from rich.table import Column, Table

    with _admin(base_url, token) as admin:
        found = admin.export_checkpoint(job_id, export) if export else admin.list_checkpoints(job_id)
    if as_json:
        _print_json(found)
        return
    if export:
        title = f"{export} (expires {found.get('expires_at', '?')})"
        table = Table("filename", "size_bytes", Column("url", no_wrap=True), title=title)
        for item in found.get("files", []):
            table.add_row(item["filename"], str(item.get("size_bytes", "")), item["url"])
    else:
        table = Table(
            Column("checkpoint_id", no_wrap=True), "global_steps", "checkpoint_type", Column("created_at", no_wrap=True)
        )
        for record in found:
            step = record.get("global_steps", record.get("global_step", ""))
            table.add_row(
                record["checkpoint_id"], str(step), record.get("checkpoint_type"), str(record.get("created_at"))
            )
    _print_table(table)


models_app = typer.Typer(help="Tiny built-in models.", no_args_is_help=True)
app.add_typer(models_app, name="models")


@models_app.command("export")
def models_export(
    spec: Annotated[str, typer.Argument(help="A tiny preset, e.g. tiny:chat.")],
    target: Annotated[Path, typer.Argument(help="The folder to write (a Hugging Face model folder).")],
    seed: Annotated[int, typer.Option(help="Initialises the weights.")] = 0,
) -> None:
    """Write a tiny model and its tokenizer to a folder that transformers (and the Tinker SDK) load offline."""
    import shutil

    from icefloe.engines.models import resolve_model
    from icefloe.protocol import ConfigError

    if not spec.startswith("tiny:"):
        raise typer.BadParameter(f"spec must be a tiny preset like tiny:chat; got {spec!r}")
    try:
        built = resolve_model(spec, seed=seed)
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="SPEC") from None
    shutil.copytree(built, target, dirs_exist_ok=True)
    console.print(f"{spec} (seed {seed}) written to {target}")


def _quiet_transformers() -> None:
    """Silence transformers' load/save notices, which would break up the demo's own bar (the engines
    turn its progress bars off themselves)."""
    from transformers.utils import logging

    logging.set_verbosity_error()


def main() -> None:
    """The ``icefloe`` console script: the app, with a missing optional package told in one line."""
    try:
        app()
    except ModuleNotFoundError as exc:
        extra = _extra_of(exc.name or "")
        if extra is None:
            raise
        command = " ".join(["icefloe", *sys.argv[1:2]])
        hint = escape(f"{command} needs {exc.name}: pip install 'icefloe[{extra}]'")
        console.print(f"[red]error:[/red] {hint}", highlight=False, soft_wrap=True)
        sys.exit(1)


def _extra_of(module: str) -> str | None:
    """The first extra in icefloe's package metadata that installs top-level ``module``, if any."""
    top = module.partition(".")[0].lower()
    try:
        requirements = importlib.metadata.requires("icefloe") or []
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return None
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement)
        extra = re.search(r"extra == \"([^\"]+)\"", requirement)
        if name and extra and name.group().lower().replace("-", "_") == top:
            return extra.group(1)
    return None


if __name__ == "__main__":
    main()
