"""Gradient compressors, one plug-in file each (read ``base.py`` first, then any plug-in).

- ``base``: ``Compressor`` (error feedback, torch or numpy input, the declared ``WireSpec`` with
  ``encode`` / ``decode``, the optional server-side ``ratio_policy``) and ``SparseCompressor``;
- plug-ins: ``none``, ``fp16``, ``topk``, ``dgc`` (and DGC's warm-up), ``randomk``, ``gdtopk``,
  ``losscomp``; ``registry`` names them (``make_compressor``);
- ``sparse_select``: the sampled-threshold top-k the magnitude compressors share;
- ``ratios``: GDTopK's server side (``IterTimer`` for a group, ``RatioPolicy`` for the global
  server, ``gdtopk_ratios``);
- ``device_compress``: selection and error feedback on the worker's torch device (the only
  module here that imports torch; nothing imports it from this package's ``__init__``).

No I/O and no clocks.
"""

__all__: list[str] = []
