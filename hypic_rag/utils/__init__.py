"""Small utilities every part may use, each one concern, importing nothing of hypic-rag but the entry format's limits:
`limits` (the ranges of the numbers and the limits on the text a user may send), `lru` (a byte-budgeted LRU map),
`paths` (checks of directories before anything is created), `reaper` (the processes a command starts go when it
goes), `streaming` (generators with a final result), `text` (checks on text that reaches a tokenizer), `units`
(quantities written for people: `human_bytes`)."""
