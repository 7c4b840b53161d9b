"""Steps 4-7 as pure logic: what an answer may be, when it ends, its text, reasoning, constraint, events, stats."""
