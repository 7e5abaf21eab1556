"""`echobench data synth` and `echobench data index`: training data as tar shards (echobench.data)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import typer

from echobench.cli.common import console, data_app, writable_dir
from echobench.records.console import esc


@data_app.command("synth", short_help="Write tar shards of (latent, speaker reference, text) triplets with lengths "
                                      "like real data's.")
def data_synth(
    out: Path = typer.Option(..., "--out", help="Directory for the shards (created)."),
    shards: int = typer.Option(4, help="Number of tar shards."),
    samples_per_shard: int = typer.Option(64),
    seed: int = typer.Option(0),
    max_seconds: float = typer.Option(30.0, help="Longest audio clip in seconds (25 latent frames/s)."),
):
    """Write tar shards of (latent, speaker reference, text) triplets in the training format, with lengths like
    real data's: audio log-normal (median 8 s, sigma 0.6) and reference log-normal (median 10 s, sigma 0.5), both
    clipped to [2 s, --max-seconds]; text at 14 characters per second of audio (x a log-normal factor, sigma 0.15).
    A run on them pads as a user's data does (--data DIR, --batching pad or bucket)."""
    from echobench.data import synth_shards

    paths = synth_shards(writable_dir(out), shards, samples_per_shard, seed=seed, max_seconds=max_seconds)
    size = sum(p.stat().st_size for p in paths)
    console.print(f"wrote {len(paths)} shards, {len(paths) * samples_per_shard} samples, {size / 1e6:.1f} MB to {esc(out)}", highlight=False)


@data_app.command("index", short_help="Index shards written elsewhere; exits 1 on a damaged shard.")
def data_index(
    data: Path = typer.Argument(..., help="Directory of *.tar shards, or one shard."),
    rebuild: bool = typer.Option(False, "--rebuild", help="Rebuild indexes that are up to date too."),
):
    """Index shards written elsewhere (synth indexes its own): each sample's member offsets and lengths, so that
    a reader seeks straight to its own samples. Beside each shard, or in echobench's cache (ECHOBENCH_CACHE)
    when its directory cannot be written; one line per shard. Exits 1 if a shard is damaged or nowhere to write."""
    from echobench.data.dataset import find_shards
    from echobench.data.index import ensure_index

    shards = find_shards(data)
    status_of, samples = Counter(), 0
    for shard in shards:
        index, status, detail = ensure_index(shard, rebuild=rebuild)
        status_of[status] += 1
        if index is not None:
            samples += index.count
            line = f"{shard.name}: {index.count} samples, {'written to' if status == 'built' else 'up to date:'} {detail}"
        elif status == "damaged":
            line = f"{shard.name}: damaged, not indexed (readers walk it; its bad samples raise or are skipped): {detail}"
        elif status == "unreadable":
            line = f"{shard.name}: cannot be read, not indexed: {detail}"
        else:
            line = f"{shard.name}: not indexed: {detail}"
        console.print(esc(line), highlight=False, soft_wrap=True)
    console.print(f"{len(shards)} shards, {samples} samples indexed: {status_of['built']} written, {status_of['fresh']} up to date, "
                  f"{status_of['damaged']} damaged, {status_of['unreadable']} unreadable, {status_of['unwritable']} with "
                  "nowhere to write", highlight=False)
    if status_of["damaged"] or status_of["unreadable"] or status_of["unwritable"]:
        raise typer.Exit(1)
