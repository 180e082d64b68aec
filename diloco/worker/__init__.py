"""One worker process: its entry point, the builders that wire train/, outer/ and ft/ together,
sharding and its environment.
"""
