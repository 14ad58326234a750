"""The library installs no output of its own: one NullHandler on the `transfer` logger."""

from __future__ import annotations

import logging

import transfer


def test_the_package_logger_has_a_null_handler_and_nothing_else():
    handlers = logging.getLogger(transfer.__name__).handlers
    assert [type(h) for h in handlers] == [logging.NullHandler]

