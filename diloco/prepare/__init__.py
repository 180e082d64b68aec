"""``role=prepare``: a corpus of text, JSONL or Parquet files tokenized once into the token file
``data=tokens`` memory-maps, with its metadata and tokenizer (``selection``: which of a folder's
files are read; ``sources``: the input files and their documents; ``tokenizer``: a given or
trained tokenizer; ``shards``: one process's files into ids; ``pipeline``: the whole run, with its
progress line). Below ``launch``, above ``train``.
"""
