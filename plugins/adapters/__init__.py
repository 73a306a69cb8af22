"""Adapters: fine-tuned adapters served on the base weights, chosen per request.

The config's ``adapter`` setting picks one by name (:mod:`pitstop.plugin_system.adapter`);
``lora`` (:mod:`~pitstop.plugins.adapters.lora`, PEFT's LoRA adapters) ships.
"""
