"""Gradient compressors (read ``base.py`` first, then any plug-in).

- ``base``: ``Compressor`` (error feedback, torch or numpy input, the declared ``WireSpec`` and
  its ``encode``, the optional server-side ``ratio_policy``), ``SparseCompressor``, and the one
  seam where arrays live (``Arrays``; ``HostArrays`` in numpy);
- plug-ins: ``dense`` (``none``, ``fp16``), ``topk`` (``topk``, ``dgc`` and its warm-up,
  ``gdtopk``, ``randomk``), ``losscomp``; ``registry`` names them (``make_compressor``); the top-k
  they share is ``selection`` (``TopKSelector``, with its tuning);
- ``ratios``: GDTopK's server side (``RatioPolicy`` for the global server, ``gdtopk_ratios``;
  the groups' iteration times it reads are ``core/ssp.py``'s ``Iterations``);
- ``device_compress``: the torch twins (``TorchTopK``, ``DeviceArrays``) that put selection and
  error feedback on the worker's device (the only module here that imports torch; nothing
  imports it from this package's ``__init__``).

No I/O and no clocks.
"""
