"""`python -m minisgl serve`: an OpenAI-compatible HTTP server, in SGLang's process layout.

    HTTP process                                   scheduler process
    connections.py (uvicorn's, with bounds)
    app.py (routes, SSE)                           scheduler_process.py
      protocol.py (OpenAI requests, 400s)            LLM.add_request / abort / step,
      engine_client.py (tokenize, submit, abort) ->  new tokens after every step
      detokenizer.py (text, stop strings)       <-   (ZMQ, messages.py)
      metrics.py (/metrics)                          grammar_queue.py (compiles, on threads)
      grammar_checker.py (parses, in child processes)

The scheduler process runs nothing but the engine's loop: tokenizing, detokenizing and the
HTTP work happen in the other process, so they never add to the scheduler's host time C (the
time the overlap loop hides behind the device). SGLang splits the detokenizer into a third
process; here it shares the HTTP process, which only waits on sockets.
"""
