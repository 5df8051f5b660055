"""The onnxps server, in folders by layer, each importing only the layers below it.

The modules here are the process on top: ``config`` (``ServerConfig`` and its
checks), ``app`` (``create_server`` wires the parts together), ``cli`` (``onnxps
serve``), ``metrics``, health, reflection and memory release; they may import every
folder. Below them: ``rpc`` (the servicer), ``replication``, ``interceptors``,
``transports``, ``durability``, ``store`` and ``kernels``, and ``errors``, the domain
errors every layer raises. tests/test_layers.py holds the table of allowed imports;
docs/architecture.md draws it (scripts/architecture.py).
"""
