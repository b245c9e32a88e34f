"""How `--help` writes options and arguments: as click always did, not as typer 0.2x started to.

Recent typer releases (0.29 here) show `<bool>` after every plain flag (`--help  -h  <bool>`),
wrap a default given as text in parentheses (`[default: (2)]`, `[default: (the source's)]`), and
write required arguments in braces in the usage line (`hfsdp ckpt reshard [OPTIONS] {src} {dst}`).
These three adjustments give back click's conventions (`SRC DST`, no type after a switch, the
default as written). Each is applied only where typer has the method it replaces, so an older or
newer typer keeps its own rendering rather than breaking.
"""

from __future__ import annotations


def install() -> None:
    """Adjust typer's help rendering (idempotent); main.py calls it once, before any command is registered."""
    from typer.core import TyperArgument, TyperOption

    if getattr(TyperOption, "_hfsdp_help", False):
        return
    if hasattr(TyperOption, "display_type_rich"):
        option_type = TyperOption.display_type_rich

        def display_type_rich(self, ctx):
            return None if self.is_flag else option_type(self, ctx)

        TyperOption.display_type_rich = display_type_rich
    for cls in (TyperOption, TyperArgument):
        if hasattr(cls, "_get_default_string"):
            cls._get_default_string = _without_parentheses(cls._get_default_string)
    if hasattr(TyperArgument, "_usage_display_name"):

        def usage_name(self) -> str:
            name = (self.metavar or self.name or "").upper()
            name = name if self.required else f"[{name}]"
            return name + ("..." if self.nargs != 1 else "")

        TyperArgument._usage_display_name = usage_name
        TyperArgument.display_name_raw = property(lambda self: (self.metavar or self.name or "").upper())
    TyperOption._hfsdp_help = True


def _without_parentheses(default_string):
    def get(self, *, ctx, show_default_is_str: bool, default_value):
        if show_default_is_str:
            return str(self.show_default)  # typer writes "(text)"; click wrote the text as given
        return default_string(self, ctx=ctx, show_default_is_str=show_default_is_str, default_value=default_value)

    return get
