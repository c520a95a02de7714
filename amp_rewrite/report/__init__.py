"""What a conversion tells: every decision with its reason (:mod:`.decisions`, read by the JSON
report and ``explain``), and the self-contained HTML pages and TensorBoard events (:mod:`.html`)."""
