"""Load tests that choose settings: the offline sweep, the online load test, their levels,
recommendation, regression gate and diagnosis."""
