"""reports: what a plan is, how it compares, and pictures of its simulated iteration.

`comparison` computes the alternatives, the single-device reference and the rows the reports
show; `text_report`, `html_report` and `timeline` only present them. Depends on `planner` and
`topology`, never the reverse; never imports TensorFlow. matplotlib (the `report` extra) is
imported only when drawing.
"""
