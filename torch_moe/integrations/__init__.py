"""Integrations of torch_moe with other libraries (each an optional dependency).

``torch_moe.integrations.transformers``: torch_moe as an HF transformers
``ExpertsInterface`` backend (``experts_implementation="torch_moe"``), FP8/MX experts via
``set_precision``, and ``to_torch_moe`` / ``from_torch_moe`` block converters. Import the
submodule explicitly; importing this package imports nothing else.
"""

__all__: list[str] = []
