// A shared library that is not a booster plugin: it exports no booster_plugin_abi_version.
extern "C" int booster_test_not_a_plugin_answer() { return 42; }
