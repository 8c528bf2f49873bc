"""The serving runtime: loads verified artifacts and generates, with no compiler imports.

`import graphc.runtime` pulls in torch, the graphc ops, the artifacts' reader and the host-side
helpers, but never the compiler, the passes, the backends' compilers, the tools or the model
(tests check `sys.modules`).
"""

from graphc.runtime.engine import Engine, Request, Result

__all__ = ["Engine", "Request", "Result"]
