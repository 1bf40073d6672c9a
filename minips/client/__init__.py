"""The worker's and the evaluator's parts: the session with the global server, connections to the
servers, set-up of model, data and compressor. minips/worker.py is their face."""
