"""Test scaffolding shared by the suite (never shipped: tests/ is not a package of moetrace)."""
