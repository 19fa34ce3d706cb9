"""The case catalogue: every module here registers its cases with @case (see the package docstring)."""
