"""What a terminal shows of Prefect's logs when ``-v`` is not given."""

from __future__ import annotations

import copy
import logging

from prefect.logging.handlers import PrefectConsoleHandler


class ConsoleWithoutTracebacks(PrefectConsoleHandler):
    """Prefect's console handler, minus the tracebacks of failed task and flow runs.

    The CLI names it in ``PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS``, which overrides the class in
    Prefect's logging config in this process and every process it starts.

    A failed command ends with one ``error:`` line; the failed runs' messages still show which task
    failed. The full tracebacks go to the Prefect API (the run's logs in the UI) and with ``-v``.
    """

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text or record.stack_info:
            # A copy: the API handler of the same logger must still send the traceback.
            record = copy.copy(record)
            record.exc_info = record.exc_text = record.stack_info = None
        return super().format(record)
