"""`logging_kept`: what a library that reconfigures logging in our process (sglang's Engine) leaves us."""

from __future__ import annotations

import io
import logging
import logging.config

from rlinf_pipe.utils.logs import logging_kept


class _Recording(logging.StreamHandler):
    def __init__(self) -> None:
        super().__init__(io.StringIO())
        self.closes = 0

    def close(self) -> None:
        self.closes += 1
        super().close()


def test_our_handlers_level_and_loggers_survive_a_forced_basic_config_and_a_dict_config():
    root = logging.getLogger()
    ours = logging.getLogger("rlinf_pipe.test_logs")
    handler = _Recording()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    before = list(root.handlers)  # (pytest's among them)
    try:
        with logging_kept():
            logging.basicConfig(level=logging.ERROR, force=True)  # as sglang's configure_logger
            assert handler not in root.handlers
        assert handler.closes == 0  # (basicConfig(force=True) closes the handlers it finds attached)
        assert root.handlers == before and root.level == logging.INFO
        with logging_kept():
            logging.config.dictConfig({"version": 1})  # as SGLANG_LOGGING_CONFIG_PATH: disables existing loggers
            assert ours.disabled
        assert root.handlers == before and not ours.disabled
        ours.info("still heard")
        assert "still heard" in handler.stream.getvalue()
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
