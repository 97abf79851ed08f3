"""A partial-credit reward (`char_match`) and a two-attempt workflow (`second_try`)."""
