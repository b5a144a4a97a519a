"""The text formats a model reads and writes around its tokens: chat templates, tool-call
markup, reasoning tags, and the GBNF grammars that constrain output. Pure text processing:
it imports nothing above the configuration."""
