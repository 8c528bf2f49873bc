"""The serving runtime: loads verified artifacts and generates, with no compiler imports.

`import graphc.runtime` pulls in torch, the graphc ops and the host-side helpers, but never the
capture, the passes, the backends' compilers or networkx (tests check `sys.modules`).
"""

from graphc.runtime.engine import Engine, Request, Result

__all__ = ["Engine", "Request", "Result"]
