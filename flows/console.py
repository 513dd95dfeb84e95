"""What a terminal shows of Prefect's logs when ``-v`` is not given."""

from __future__ import annotations

import copy
import logging

from prefect.logging.handlers import PrefectConsoleHandler

# Prefect's words for a run that Ctrl-C (an interrupt signal) or SIGTERM (a termination signal) ended.
_STOPPED_BY_SIGNAL = "Execution was aborted by a"


class ConsoleWithoutTracebacks(PrefectConsoleHandler):
    """Prefect's console handler, minus the tracebacks of failed task and flow runs.

    The CLI names it in ``PREFECT_LOGGING_HANDLERS_CONSOLE_CLASS``, which overrides the class in
    Prefect's logging config in this process and every process it starts.

    A failed command ends with one ``error:`` line; the failed runs' messages still show which task
    failed. The full tracebacks go to the Prefect API (the run's logs in the UI) and with ``-v``.

    A command stopped by Ctrl-C or SIGTERM ends with one ``interrupted:`` line (``flows.cli.interrupts``):
    the runs' "Crash detected! Execution was aborted by an interrupt signal" lines, one or two for each
    flow and task run, are left to the API's log.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if _STOPPED_BY_SIGNAL in record.getMessage():
            return False
        return bool(super().filter(record))

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info or record.exc_text or record.stack_info:
            # A copy: the API handler of the same logger must still send the traceback.
            record = copy.copy(record)
            record.exc_info = record.exc_text = record.stack_info = None
        return super().format(record)
