"""Our tiered Valkey + S3 store as LMCache's L2: the adapter LMCache's server loads as an
``--l2-adapter`` plugin (:mod:`.adapter`, ``kvprefetch.agents.lmcache.l2.adapter:
KvPrefetchL2Adapter``), its parameters and plugin JSON (:mod:`.params`), the tiers behind it
and what each LMCache operation does to them (:mod:`.stores`), its object names and the
tiers' listings (:mod:`.listing`), and LMCache's task protocol (:mod:`.tasks`).

Importing this package imports no LMCache: it exports the parameters and the plugin JSON,
which the harness and the deployment tools build without it; the adapter and the modules
it drives import LMCache and are imported by name.
"""

from kvprefetch.agents.lmcache.l2.params import (
    CLASS_NAME,
    MODULE_PATH,
    KvPrefetchL2Params,
    load_params,
    plugin_adapter_json,
)

__all__ = ["CLASS_NAME", "MODULE_PATH", "KvPrefetchL2Params", "load_params",
           "plugin_adapter_json"]
