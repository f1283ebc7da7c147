"""The benchmark harness: timing, device facts, saved histories and the regression gate."""
