"""The fault tests' request stream lives in `kvd.traffic` (the chaos run uses it too)."""

from kvd.traffic import D_TERMINAL, HOST, NOT_OFFERED, P_TERMINAL, Req, Traffic

__all__ = ["D_TERMINAL", "HOST", "NOT_OFFERED", "P_TERMINAL", "Req", "Traffic"]
