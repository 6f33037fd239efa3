"""The `mesh-llm` command: parses flags, then calls into the package. Errors a user can fix print one
line and exit with code 2."""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from mesh_llm.bench.cli import bench_command
from mesh_llm.system import native

app = typer.Typer(help="Serve LLMs from MLX and llama.cpp engines behind one OpenAI-compatible API.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
models_app = typer.Typer(help="Find, download and convert models.", no_args_is_help=True)
app.add_typer(models_app, name="models")
mesh_app = typer.Typer(help="Inspect a mesh of mesh-llm nodes.", no_args_is_help=True)
app.add_typer(mesh_app, name="mesh")
app.command("bench")(bench_command)

console = Console(stderr=True)


def fail(message: str) -> typer.Exit:
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return typer.Exit(code=2)


def setup_logging(level: str) -> None:
    handler = (RichHandler(console=console, show_path=False, rich_tracebacks=False)
               if console.is_terminal else logging.StreamHandler(sys.stderr))
    if not console.is_terminal:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


class ProgressBars:
    """Rich progress bars for loads and imports; ``bar(label)`` gives a ``progress(done, total)``."""

    def __init__(self):
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                  TimeRemainingColumn(), console=console, transient=True,
                                  disable=not console.is_terminal)
        self._started = False

    def bar(self, label) -> callable:
        name = getattr(label, "id", label)
        task = None

        def update(done: int, total: int) -> None:
            nonlocal task
            if not self._started:
                self._progress.start()
                self._started = True
            if task is None:
                task = self._progress.add_task(f"loading {name}", total=total)
            self._progress.update(task, completed=done, total=total)
            if all(t.finished for t in self._progress.tasks):
                self._progress.stop()
                self._started = False

        return update


@app.command()
def serve(
    model: list[str] = typer.Option([], "--model", "-m", help="A model folder, a .gguf file, an HF repo id "
                                    "(org/name[@revision]) from the local cache, or a name from "
                                    "`mesh-llm models list`. Repeat to serve several. Default: the "
                                    "embedded SmolLM2-135M-Instruct."),
    engine: str = typer.Option("auto", help="auto, mlx or llama."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(9337, help="Port to listen on."),
    api_key: Optional[str] = typer.Option(None, envvar="MESH_LLM_API_KEY",
                                          help="Require 'Authorization: Bearer KEY' on every route but /health."),
    cors_origin: list[str] = typer.Option([], help="A browser origin allowed to call the API (repeatable; '*' "
                                          "for any). Default: http://localhost:* and http://127.0.0.1:*."),
    no_cors: bool = typer.Option(False, "--no-cors", help="Allow no browser origin."),
    ctx_size: Optional[int] = typer.Option(None, help="Context length (default or 0: the model's own, "
                                           "fitted to memory)."),
    quantize: Optional[int] = typer.Option(None, help="4 or 8: quantize on load (MLX on a GPU)."),
    alias: list[str] = typer.Option([], help="Id to serve each --model under, in order."),
    threads: Optional[int] = typer.Option(None, help="CPU threads (default: physical cores)."),
    max_queue: int = typer.Option(
        64, help="Requests that may wait per model beyond its free batch slots before a 429 (0: none wait)."),
    read_timeout: float = typer.Option(30.0, help="Seconds a request's headers and body may take to "
                                       "arrive before a 408 and the connection closed."),
    request_timeout: Optional[float] = typer.Option(
        None, help="Seconds a generation may take from arrival to its last token before it is ended with "
        "a 504 request_timeout (a stream: an error event); default: no limit."),
    max_batch: Optional[int] = typer.Option(None, help="Sequences decoded together per model "
                                            "(default: chosen from the device and its memory)."),
    prefill_step: Optional[int] = typer.Option(None, envvar="MESH_LLM_PREFILL_STEP", help="Most prompt "
                                               "tokens of one sequence read in one forward pass "
                                               "(default 512; 1024 on MLX on a GPU)."),
    cache_bytes: Optional[str] = typer.Option(None, help="Prompt cache size per model: bytes, or "
                                              "512M, 2G; 0 turns it off. Default: a quarter of the "
                                              "memory free after loading, at most 16G."),
    cache_entries: int = typer.Option(64, help="Most prompt states the cache keeps per model."),
    kv_memory: Optional[str] = typer.Option(None, help="Memory the running sequences' KV cache may "
                                            "take per model: bytes, or 512M, 2G. Past it the newest "
                                            "sequence waits (preempted); the context is fitted to it "
                                            "unless --ctx-size is given. Default: half the memory "
                                            "free after loading (llama), three quarters counted "
                                            "twice (MLX)."),
    warm_up: Optional[bool] = typer.Option(None, "--warm-up/--no-warm-up", help="Run the shapes serving "
                                           "uses once before ready, so the first request is as fast as "
                                           "later ones (default: on a GPU, both engines)."),
    deterministic: bool = typer.Option(False, "--deterministic", help="llama engine on a CPU: a "
                                       "request's tokens and logprobs are bit for bit the same alone, "
                                       "batched or resumed from the prompt cache (bfloat16 KV cells: "
                                       "decode up to 1.6x and long prompts 2x slower)."),
    log_level: str = typer.Option("info", envvar="MESH_LLM_LOG_LEVEL", help="debug (each engine step), "
                                  "info, warning or error."),
    mesh: bool = typer.Option(False, "--mesh", help="Start a mesh with a fresh random token and print "
                              "the command that joins it.", rich_help_panel="Mesh"),
    mesh_token: Optional[str] = typer.Option(None, help="The mesh's shared secret: alone it starts a mesh; "
                                             "with --join it joins one. MESH_LLM_MESH_TOKEN stands in for "
                                             "it with --join, --client or --discover, but starts no mesh alone.",
                                             rich_help_panel="Mesh"),
    join: list[str] = typer.Option([], help="A member's address (http(s)://host:port: its mesh port, or its "
                                    "API port, which names the mesh port) to join the mesh through; "
                                    "repeatable.", rich_help_panel="Mesh"),
    client: bool = typer.Option(False, "--client", help="Join as an API-only node that serves no model.",
                                rich_help_panel="Mesh"),
    discover: bool = typer.Option(False, "--discover", help="Find members with the same token on the "
                                  "local network by mDNS, and be found.", rich_help_panel="Mesh"),
    node_name: Optional[str] = typer.Option(None, help="This node's id in the mesh; its signing key is kept under "
                                            "that name (default: hostname-<random>).", rich_help_panel="Mesh"),
    mesh_port: Optional[int] = typer.Option(None, help="The port peers reach this node at, TLS with its "
                                            "node key (default: --port + 1 when --host is not loopback; on "
                                            "loopback, peers use the API port).", rich_help_panel="Mesh"),
    advertise_url: Optional[str] = typer.Option(None, help="The address peers use to reach this node "
                                                "(default: from --host and the mesh port, or --port).",
                                                rich_help_panel="Mesh"),
    first_byte_timeout: float = typer.Option(10.0, help="Seconds a peer may stay silent before the next "
                                             "node is tried.", rich_help_panel="Mesh"),
    stream_idle_timeout: float = typer.Option(60.0, help="Seconds a forwarded answer may stop midway "
                                              "before it is ended with an error (0: never).",
                                              rich_help_panel="Mesh"),
    tls_cert: Optional[str] = typer.Option(None, help="Serve HTTPS with this certificate (PEM).",
                                           rich_help_panel="TLS"),
    tls_key: Optional[str] = typer.Option(None, help="The certificate's private key (PEM).",
                                          rich_help_panel="TLS"),
    tls_ca: Optional[str] = typer.Option(None, help="CA bundle to verify peers' certificates (default: "
                                         "the system's).", rich_help_panel="TLS"),
) -> None:
    """Serve models on an OpenAI-compatible API (http://HOST:PORT/v1)."""
    if engine == "mlx" and native.mlx_load_problem():  # every model goes to MLX: start again before
        native.relaunch_without_llama()  # serve's imports (with the CLI's, 0.38-0.42 s on an H100)
    from mesh_llm.engines.base import EngineOptions
    from mesh_llm.serve import Relaunch, ServeConfig, StartupError
    from mesh_llm.serve import serve as run

    setup_logging(log_level)
    if engine not in ("auto", "mlx", "llama"):
        raise fail(f"--engine must be auto, mlx or llama, not {engine!r}")
    if quantize not in (None, 4, 8):
        raise fail("--quantize must be 4 or 8")
    if ctx_size is not None and ctx_size < 0:
        raise fail("--ctx-size must be a token count, or 0 for the model's own")
    if threads is not None and threads < 1:
        raise fail("--threads must be at least 1")
    if max_queue < 0:
        raise fail("--max-queue must be 0 or more")
    if no_cors and cors_origin:
        raise fail("--no-cors and --cors-origin do not go together")
    if not read_timeout > 0:
        raise fail("--read-timeout must be more than 0")
    if request_timeout is not None and not request_timeout > 0:
        raise fail("--request-timeout must be more than 0")
    if cache_entries < 0:
        raise fail("--cache-entries must be 0 or more")
    if max_batch is not None and max_batch < 1:
        raise fail("--max-batch must be at least 1")
    if prefill_step is not None and prefill_step < 16:
        raise fail("--prefill-step must be at least 16")
    try:
        cache_size = None if cache_bytes is None else parse_bytes(cache_bytes)
    except ValueError:
        raise fail(f"--cache-bytes must be a byte count such as 512M, 2G or 0, not {cache_bytes!r}") \
            from None
    kv_bytes = None
    if kv_memory is not None:
        try:
            kv_bytes = parse_bytes(kv_memory)
        except ValueError:
            kv_bytes = 0
        if kv_bytes <= 0:
            raise fail(f"--kv-memory must be a byte count such as 512M or 2G, not {kv_memory!r}")
    mesh_config = None
    if mesh or mesh_token or join or client or discover:
        mesh_config = mesh_settings(mesh, mesh_token, join, client, discover, node_name, advertise_url,
                                    first_byte_timeout, tls_ca, stream_idle_timeout, mesh_port)
    options = EngineOptions(ctx_size=ctx_size, quantize=quantize, threads=threads, prefill_step=prefill_step,
                            cache_bytes=cache_size, kv_bytes=kv_bytes, cache_entries=cache_entries,
                            max_batch=max_batch, warm_up=warm_up, deterministic=deterministic)
    config = ServeConfig(models=model, aliases=alias, engine=engine, host=host, port=port,
                         api_key=api_key or None, options=options, max_queue=max_queue,
                         read_timeout=read_timeout, request_timeout=request_timeout,
                         tls_cert=tls_cert, tls_key=tls_key, mesh=mesh_config,
                         cors_origins=[] if no_cors else cors_origin or None)
    try:
        code = run(config, progress_factory=ProgressBars().bar)
    except Relaunch:  # this process cannot run MLX; the same command in a fresh one can
        native.relaunch_without_llama()
    except StartupError as exc:
        fail(str(exc))
        code = 2
    except KeyboardInterrupt:  # uvicorn raises the SIGINT it caught again once it has shut down
        code = 130
    # The workers have stopped and closed their engines. Skip C++ static destructors: MLX's abort
    # ("terminate called without an active exception", exit -6) when a stream thread outlives them.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def mesh_settings(mesh: bool, token: str | None, join: list[str], client: bool, discover: bool,
                  node_name: str | None, advertise_url: str | None, first_byte_timeout: float,
                  tls_ca: str | None, stream_idle_timeout: float, mesh_port: int | None = None):
    """The mesh flags as a MeshConfig, or a one-line error."""
    from mesh_llm.mesh import MeshConfig, new_token

    token = token or os.environ.get("MESH_LLM_MESH_TOKEN") or None
    if token is None and (join or client or discover):
        raise fail("--join, --client and --discover need the mesh's token: --mesh-token TOKEN or "
                   "MESH_LLM_MESH_TOKEN")
    if not first_byte_timeout > 0:
        raise fail("--first-byte-timeout must be a positive number of seconds")
    if not stream_idle_timeout >= 0:
        raise fail("--stream-idle-timeout must be 0 (never) or a positive number of seconds")
    for url in [*join, *([advertise_url] if advertise_url else [])]:
        if not url.startswith(("http://", "https://")):
            raise fail(f"{url!r} is not an API address: write http(s)://host:port")
    if mesh_port is not None and not 0 <= mesh_port <= 65535:
        raise fail("--mesh-port must be a port number (0: any free port)")
    if node_name is not None and not re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", node_name):
        raise fail("--node-name may use letters, digits and . _ : - (at most 128)")
    return MeshConfig(token=token or new_token(), join=join, client=client, discover=discover,
                      node_name=node_name, advertise_url=advertise_url, tls_ca=tls_ca, port=mesh_port,
                      first_byte_timeout=first_byte_timeout, stream_idle_timeout=stream_idle_timeout,
                      generated_token=token is None)


def parse_bytes(text: str) -> int:
    """``2G``, ``512M``, ``1.5g``, ``64KiB`` or plain bytes, in powers of 1024."""
    number = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = 1
    if number and number[-1] in "KMGT":
        scale, number = 1024 ** ("KMGT".index(number[-1]) + 1), number[:-1]
    value = float(number) * scale
    if not 0 <= value < 2**63:  # also refuses nan and inf
        raise ValueError(text)
    return int(value)


@models_app.command("list")
def models_list() -> None:
    """Models found in the Hugging Face cache, mesh-llm's cache, and the embedded default."""
    from mesh_llm.models import list_models

    header = ("name", "ref (for --model)", "format", "size", "engine", "path")
    rows = [(m.name, m.ref, ", ".join(m.formats), f"{m.size_bytes / 1e6:,.0f} MB", m.engine, str(m.path))
            for m in list_models()]
    out = Console()
    if not out.is_terminal:  # scripts get one tab-separated line per model
        for row in (header, *rows):
            print("\t".join(row))
        return
    table = Table(*header)
    for row in rows:
        table.add_row(*row)
    out.print(table)


@models_app.command("download")
def models_download(
    repo: str = typer.Argument(..., help="org/name[@revision] on the Hugging Face Hub."),
    include: list[str] = typer.Option([], help="Only files matching these glob patterns."),
) -> None:
    """Download a model from the Hugging Face Hub into its local cache (the only networked command)."""
    from mesh_llm.models.download import download

    repo_id, _, revision = repo.partition("@")
    try:
        path = download(repo_id, revision=revision or None, include=include or None)
    except Exception as exc:  # huggingface_hub raises many kinds; each is one line for the user
        raise fail(f"download of {repo} failed: {exc}") from None
    console.print(f"downloaded {repo} to {path}", markup=False)


@models_app.command("import-gguf")
def models_import_gguf(
    src: Path = typer.Argument(..., help="A .gguf file (llama, qwen2 or qwen3 architecture)."),
    out_dir: Path = typer.Argument(..., help="The MLX model folder to write."),
    dtype: Optional[str] = typer.Option(None, help="bfloat16 or float32: dequantize; default keeps "
                                        "Q4_0/Q4_1/Q8_0 quantized in MLX's format."),
) -> None:
    """Write an MLX model folder (config.json, model.safetensors, tokenizer) from a GGUF file."""
    from mesh_llm.engines import engine_class
    from mesh_llm.engines.base import EngineError

    if dtype not in (None, "bfloat16", "float32", "float16"):
        raise fail("--dtype must be bfloat16, float16 or float32")
    if native.mlx_load_problem():  # before MLX is imported: the fresh process imports it
        native.relaunch_without_llama()
    try:
        engine_class("mlx")  # the import uses MLX to read GGUF tensors
    except EngineError as exc:
        raise fail(str(exc)) from None
    from mesh_llm.models.gguf_convert import GGUFConvertError, import_gguf
    from mesh_llm.system.blas import ensure_fast_blas

    ensure_fast_blas()
    if out_dir.exists():
        raise fail(f"{out_dir} already exists")
    try:
        path = import_gguf(src, out_dir, dtype=dtype, progress=ProgressBars().bar(src.name))
    except GGUFConvertError as exc:
        raise fail(str(exc)) from None
    console.print(f"wrote {path}", markup=False)


@mesh_app.command("status")
def mesh_status(
    url: str = typer.Option(..., help="Any member's API address, http(s)://host:port."),
    mesh_token: Optional[str] = typer.Option(None, envvar="MESH_LLM_MESH_TOKEN", help="The mesh's token."),
    api_key: Optional[str] = typer.Option(None, envvar="MESH_LLM_API_KEY",
                                          help="The node's API key, instead of the token."),
    tls_ca: Optional[str] = typer.Option(None, help="CA bundle to verify the node's certificate."),
    as_json: bool = typer.Option(False, "--json", help="Print the node's /api/mesh answer as it is."),
) -> None:
    """Members of a mesh, their models, health, load and last heartbeat, as one node sees them."""
    import json

    from mesh_llm.mesh.status import HEADER, StatusError, fetch, rows

    try:
        mesh = fetch(url, mesh_token, api_key, tls_ca)
    except StatusError as exc:
        raise fail(str(exc)) from None
    if as_json:
        print(json.dumps(mesh, indent=2))
        return
    out = Console()
    if not out.is_terminal:
        for row in (HEADER, *rows(mesh)):
            print("\t".join(row))
        return
    table = Table(*HEADER, title=f"mesh seen from {mesh.get('node')}")
    for row in rows(mesh):
        table.add_row(*row)
    out.print(table)


def main() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    app()


if __name__ == "__main__":
    main()
