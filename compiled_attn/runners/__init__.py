"""The bucketed graph runners of the core: ``DecodeGraphs`` (``decode``), ``VerifyGraphs`` (``verify``) and
``ExtendGraphs`` (``extend``), each a ``graphs.BucketedGraphs`` of compiled, captured steps per bucket."""
