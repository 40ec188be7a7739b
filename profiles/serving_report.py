"""Render a ServingProfile: GPU time per kernel category in prefill and in decode, then the largest kernels."""
from __future__ import annotations

from .kernel_categories import ATTENTION, CATEGORIES, classify
from .profile_sections import Section, num_cell, render_sections, short_name
from .serving import ServingProfile


def category_section(profile: ServingProfile) -> Section:
    server = profile.server
    backend = server.get("attention_backend") or "default attention backend"
    headers = ["stage", "GPU kernel ms", "window ms", f"{ATTENTION} ms", *(f"{c} %" for c in CATEGORIES)]
    rows = [[stage.stage, num_cell(stage.gpu_us / 1e3, 2), num_cell(stage.window_us / 1e3, 2),
             num_cell(stage.total_us(ATTENTION) / 1e3, 2), *(num_cell(100 * stage.share(c)) for c in CATEGORIES)]
            for stage in profile.stages()]
    notes = [f"prefill: {profile.batch} prompt(s) of {profile.input_len} tokens, at most {profile.steps} forward "
             f"steps; decode: {profile.steps} steps of a batch of {profile.batch} at ~{profile.input_len} tokens "
             f"of context",
             "GPU kernel ms sums every device event (kernels, memcpy, memset) of TP rank 0; the window runs from "
             "the first one's start to the last one's end, so window - GPU kernel ms is time the GPU sat idle"]
    notes += [f"{stage.stage} trace: {stage.trace_path}" for stage in profile.stages()]
    title = f"GPU time by kernel category: {server.get('model_path', profile.url)} ({backend})"
    return Section(title, headers, rows, notes)


def kernel_section(profile: ServingProfile) -> Section:
    headers = ["stage", "category", "kernel", "calls", "total us", "% of stage"]
    rows = [[stage.stage, classify(kernel.name), short_name(kernel.name), str(kernel.calls),
             num_cell(kernel.total_us), num_cell(100 * kernel.total_us / stage.gpu_us)]
            for stage in profile.stages() for kernel in stage.top_kernels]
    return Section("Largest GPU kernels per stage", headers, rows, [])


def serving_sections(profile: ServingProfile) -> list[Section]:
    return [category_section(profile), kernel_section(profile)]


def render_serving(profile: ServingProfile, console: object | None = None) -> None:
    """Print with rich (to `console`, a rich Console, if given), or as plain text if rich fails."""
    render_sections(serving_sections(profile), console)
