"""Drivers: thin trio code that turns I/O into core inputs and core effects into I/O."""
