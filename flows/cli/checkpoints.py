"""``mlstm-sentiment checkpoints sign``: vouch for checkpoints saved before signing was on by default."""

from __future__ import annotations

from typing import Annotated

import typer

from flows.cli.common import StoreOption, fail, out, user_errors
from tasks.settings import get_settings

app = typer.Typer(help="Look after the checkpoints in the store.", no_args_is_help=True)


@app.command()
def sign(
    checkpoint: Annotated[
        str,
        typer.Argument(
            metavar="RUN_OR_URI",
            help="A run's name in the store, its folder (every step), or one checkpoint folder "
            "(…/checkpoints/step-NNNNNNN).",
        ),
    ],
    store: StoreOption = None,
) -> None:
    """Sign checkpoints as they are now with this installation's key (MLSTM_CHECKPOINT_KEY, else the key
    under MLSTM_HOME), so that every reader takes them. Only for checkpoints you know are your pipeline's:
    saved before signing was on by default, or under a key you no longer use. A file that no longer
    matches the sha256 its meta.json recorded is not signed."""
    from tasks.jobs.checkpoint import sign_checkpoints

    settings = get_settings(store_uri=store)
    try:
        signed = sign_checkpoints(
            checkpoint,
            settings.resolved_store_uri,
            endpoint_url=settings.s3_endpoint_url,
            max_attempts=settings.s3_max_attempts,
        )
    except user_errors(OSError) as error:
        raise fail(error) from None
    for uri in signed:
        out.print(f"signed {uri}", highlight=False, soft_wrap=True)
