"""Run as a script: binds each listener of the library to a port below 1024 as an unprivileged user (the
`nobody` user when started as root, having imported everything first) and prints, as one JSON object, what
each bind raised: [class name, its bases' names, errno, text], or null where it bound."""

from __future__ import annotations

import encodings.idna  # noqa: F401  # the sender pool resolves its host: after setuid nothing more can be imported
import json
import os
import sys

import torch

from transfer.bootstrap import BootstrapServer
from transfer.metrics import Metrics
from transfer.receiver import SessionManager
from transfer.sender import SenderPool
from transfer.wire_engine import WireEngine

HOST = "127.0.0.1"
NOBODY = 65534


def main(port: int) -> None:
    with WireEngine(HOST) as engine:
        buffer = torch.zeros(1024, dtype=torch.uint8)
        listeners = {
            "bootstrap server": lambda: BootstrapServer(HOST, port),
            "wire listener": lambda: WireEngine(HOST, port),
            "status socket": lambda: SessionManager(engine, 0, 1, buffer=buffer, host=HOST, status_port=port),
            "request socket": lambda: SenderPool(engine, 0, 1, 1, f"{HOST}:1", host=HOST, port=port,
                                                 register_timeout_s=1),
            "metrics endpoint": lambda: Metrics("epd_unprivileged").serve(HOST, port),
        }
        if os.geteuid() == 0:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        raised: dict[str, object] = {}
        for name, listen in listeners.items():
            try:
                listen().close()
                raised[name] = None
            except Exception as error:  # noqa: BLE001 - reported to the test, which judges it
                raised[name] = [type(error).__name__, [base.__name__ for base in type(error).__mro__],
                                getattr(error, "errno", None), str(error)]
    print(json.dumps(raised))


if __name__ == "__main__":
    main(int(sys.argv[1]))
