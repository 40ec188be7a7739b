"""What the commands that serve several backends one after another share (`logits`, `accuracy serve`): reading
--backend, --ref and --url, and the server options of each backend."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..errors import UserError

if TYPE_CHECKING:
    from ...backends.specs import BackendSpec
    from ..bench.runner import BenchOptions


def served_backends(backend: str, ref: str, url: str | None, engine: str, *, ref_with_urls: bool = False
                    ) -> tuple[str, list[str], dict[str, str]]:
    """(the engine, the backend names as given, each one's server URL where --url gives them, one per backend in
    order). A bad --ref fails like a bad --backend; with ``ref_with_urls`` servers given by --url must include the
    reference's."""
    from ..harness.engines import resolve_backends, resolve_engine

    urls = [u.strip() for u in url.split(",")] if url else None
    chosen_engine = resolve_engine(engine, urls[0] if urls else None)
    names = [n.strip() for n in backend.split(",") if n.strip()]
    resolve_backends(ref, chosen_engine)
    if urls and ref_with_urls and ref not in names:
        raise UserError(f"--ref {ref} must be one of --backend when --url gives the servers")
    if urls and len(urls) != len(names):
        raise UserError(f"--url: {len(urls)} URL(s) for {len(names)} backend(s); give one per backend")
    return chosen_engine, names, dict(zip(names, urls)) if urls else {}


def options_per_backend(engine: str, url_of: dict[str, str], run_dir: Path, port: int | None, time_scale: float,
                        ready_timeout: float | None, server_args: list[str], prefill_kernel: str | None
                        ) -> Callable[[BackendSpec], BenchOptions]:
    """The server options of each backend: the same for all but the URL --url gave it."""
    from ..bench.runner import BenchOptions

    def options_for(spec: BackendSpec) -> BenchOptions:
        return BenchOptions(engine=engine, run_dir=run_dir, url=url_of.get(spec.name), port=port,
                            time_scale=time_scale, ready_timeout_s=ready_timeout, server_args=list(server_args),
                            prefill_kernel=prefill_kernel)

    return options_for
