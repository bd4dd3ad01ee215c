"""WebShop (Yao et al. 2022) as RAGEN plays it (ragen/env/webshop over webshop-minimal), offline, stdlib only.

The original runs a Flask/Jinja site in-process, searches a Lucene (pyserini, Java) index and tags
title nouns with spaCy. Here the same page flow, action strings, `text` observations and reward
formula are written directly: a seeded synthetic catalog in WebShop's product schema (categories,
product types, attributes, option groups, prices, near-miss decoys), goals built the WebShop way
(one per option combination, shuffled with seed 233, test/val/train by index), a hand-written BM25
index, and WebShop's reward with its fuzzy matching (`token_set_ratio > 85`) and quirks. The real
1k-product WebShop files can be loaded instead (`--items/--attrs`); none of that data ships here.

Deliberate differences from upstream (see README): the catalog is synthetic, so scores are not
comparable with published WebShop numbers; BM25 uses a light plural stemmer, not Lucene's Porter
analyzer; title nouns come from product metadata instead of spaCy; hidden prices and price bounds
are seeded (upstream draws them from the unseeded global RNG); an unavailable action (e.g. a search
from an item page) is a no-op, where WebShop would still execute it; no html/text_rich modes.

  python env_webshop.py --seed 3                    # play a shop in the terminal
  python env_webshop.py --oracle 500 --random 500   # scripted oracle vs random clicker
  python env_webshop.py --stats                     # build times, splits, BM25 top-10 rate, step times
"""
import itertools
import json
import math
import os
import random
import re
import statistics
import time
from collections import Counter

# ----------------------------------------------------------------------------- RAGEN's prompt pieces
WEBSHOP_INSTRUCTION = (  # config/envs.yaml, tag WebShop, env_instruction (verbatim, double space included)
    "You are browsing an online shop. Based on the instruction, buy a product that close to the production "
    "description. You need to search, read the search results, pick a product, choose the size and color and "
    "buy. You should only choose action from the available actions list provided later.  Example process: I "
    "need a gingko light and 20x20 pillow cover that is hand painted. First search[gingko light 20x20 pillow "
    "cover hand painted], answer format: <answer>search[blanket with fleece throw]</answer>. Valid answer is "
    "search[<keywords>] or click[<clickable>].")

RENDER_INSTRUCTIONS = [  # ragen/env/webshop/env.py; the missing comma after the 6th line glues two hints (kept)
    "We must buy a product within 10 actions. It doesn't have to match perfectly with description.",
    "Search term should not include details like size, color.",
    "Never search for more than 2 times.",
    "Do not be too strict about the description, it's more important to buy one that is close enough "
    "within action limit.",
    "Prioritize click a product in the current page over going to next page.",
    "Almost never click[next >] for more than 2 times."
    "Almost never click[< prev] unless you are sure the product is on one of the previous pages.",
    "If you have less than 3 actions left, just buy the first product you see in the current page.",
    "If an matching option exists, make sure to click[size] then click[color], one at a time, before "
    "click[buy now], but don't have to if only 1 action left, in that case you just click[buy now]. "
    "Never click description.",
]

PRESETS = {  # config/envs.yaml tag WebShop (dataset small -> our 1,000-product catalog); _6_webshop.yaml
    # WebShopEnvConfig has no grid_vocab / action_lookup, so RAGEN's prompt prefix is env_instruction alone
    "WebShop": dict(kwargs=dict(num_products=1000, catalog_seed=0), instruction=WEBSHOP_INSTRUCTION,
                    max_actions_per_traj=9, max_tokens=200,
                    max_turns=9, max_actions_per_turn=1, max_context=15000),  # _6_webshop.yaml agent_proxy, max_model_len
}

# ----------------------------------------------------------------------------- WebShop constants
SEARCH_RETURN_N, PAGE_SIZE = 50, 10            # web_agent_site/utils.py: top 50, 10 results per page
PRICE_RANGE = [10.0 * i for i in range(1, 100)]  # engine/goal.py: price bounds $10 .. $990
ITEM_BUTTONS = ["back to search", "< prev", "description", "features", "reviews", "buy now"]
SUB_PAGES = {"description", "features", "reviews"}
COLOR_SET = (  # engine/normalize.py COLOR_SET, same order (normalize_color returns the first substring hit)
    "alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux bronze brown burgundy "
    "camel camo caramel champagne charcoal cheetah chestnut chocolate christmas coffee cognac copper coral "
    "cranberry cream crystal dark denim eggplant elephant espresso fuchsia gold granite grape graphite grass "
    "gray green grey heather indigo ivory ivy khaki lavender lemon leopard light lilac lime magenta maroon "
    "mauve merlot midnight mint mocha multicolor mushroom mustard natural navy nude olive orange peach "
    "pewter pink plum purple rainbow red rose royal rust sand sapphire seashell silver skull slate steel "
    "stone stonewash sunflower tan taupe teal tiger turquoise violet walnut wheat white wine yellow").split()
STOPWORDS = set(  # Lucene's English stop set (33 words), used by the analyzer and the noun heuristic
    "a an and are as at be but by for if in into is it no not of on or such that the their then there "
    "these they this to was will with".split())

# ----------------------------------------------------------------------------- catalog lexicon
# Option groups: (name shown on the item page, value pool). Values are lower case like WebShop's and
# none contains a COLOR_SET word inside a longer word ("standard" -> "tan" would break the match).
OPTION_POOLS = {
    "color": ("color", "black|white|navy|red|grey|pink|green|beige|burgundy|olive|khaki|royal blue|light blue|"
                       "dark grey|wine red|multicolor"),
    "size": ("size", "x-small|small|medium|large|x-large|xx-large|3x-large|4x-large"),
    "shoe": ("size", "6|6.5|7|7.5|8|8.5|9|9.5|10|11|12"),
    "waist": ("size", "28w x 30l|29w x 30l|30w x 30l|31w x 32l|32w x 32l|33w x 32l|34w x 32l|36w x 34l|38w x 34l"),
    "bed": ("size", "twin|full|queen|king|california king"),
    "panel": ("size", "42 x 45 inch|42 x 63 inch|42 x 84 inch|52 x 63 inch|52 x 84 inch|52 x 95 inch|52 x 108 inch"),
    "rug": ("size", "2 x 3 feet|3 x 5 feet|4 x 6 feet|5 x 7 feet|6 x 9 feet|8 x 10 feet|9 x 12 feet"),
    "pillow": ("size", "12 x 20 inch|16 x 16 inch|18 x 18 inch|20 x 20 inch|22 x 22 inch|24 x 24 inch|26 x 26 inch"),
    "length": ("size", "1 feet|3 feet|6 feet|10 feet|15 feet|25 feet"),
    "floz": ("size", "1.7 fl oz|3.4 fl oz|8 fl oz|16 fl oz|32 fl oz"),
    "ounce": ("size", "4 ounce|8 ounce|12 ounce|16 ounce|24 ounce|32 ounce|48 ounce"),
    "pack": ("size", "pack of 1|pack of 2|pack of 3|pack of 4|pack of 6|pack of 12|pack of 24"),
    "scent": ("scent", "lavender|vanilla|coconut|fresh linen|ocean breeze|unscented|eucalyptus"),
    "flavor": ("flavor name", "original|chocolate|salted caramel|honey|strawberry|peach mango|cinnamon"),
    "roast": ("flavor name", "light roast|medium roast|dark roast|french vanilla|hazelnut"),
    "capacity": ("capacity", "5000mah|10000mah|15000mah|20000mah|26800mah|30000mah"),
    "phone": ("style", "iphone 13|iphone 13 pro|iphone 14|iphone 14 pro|galaxy s22|galaxy s23|pixel 7"),
    "style": ("style", "classic|modern|vintage|minimalist|bohemian|retro"),
}
# category -> (breadcrumb root, attribute pool shared by its types, title fillers, product types). A type is
# (query, head phrase, breadcrumb tail, type attributes, option groups, price band). Decoys come from the
# 20 products of a type (same head noun, other attributes/options/prices) and from nouns shared across
# types ("dress shirt" / "dress", "usb cable" / "hdmi cable").
CATALOG = {
    "beauty": ("Beauty & Personal Care",
               "paraben free|cruelty free|long lasting|easy to use|travel size|natural ingredients|sensitive skin|"
               "dermatologist tested|fragrance free|high quality|non toxic|vegan|alcohol free|dry skin", [
        "Gift Set for Women", "Daily Care", "for Men and Women", "Travel Kit", "Salon Quality", "Value Pack"], [
        ("lip balm", "lip balm", "Skin Care › Lips › Balms & Moisturizers",
         "shea butter|spf 15|tinted|moisturizing", "flavor pack", (3, 15)),
        ("face moisturizer", "face moisturizer", "Skin Care › Face › Creams & Moisturizers",
         "hyaluronic acid|anti aging|oil free|spf 30", "ounce", (12, 60)),
        ("shampoo", "shampoo", "Hair Care › Shampoo & Conditioner › Shampoos",
         "sulfate free|color safe|dry hair|argan oil", "floz scent", (8, 35)),
        ("nail polish", "nail polish", "Foot, Hand & Nail Care › Nail Art & Polish › Nail Polish",
         "quick dry|chip resistant|glossy finish|gel", "color", (5, 20)),
        ("eyeshadow palette", "eyeshadow palette", "Makeup › Eyes › Eyeshadow",
         "highly pigmented|shimmer|matte|blendable", "style", (8, 40)),
        ("hair dryer", "hair dryer", "Hair Care › Styling Tools & Appliances › Hair Dryers",
         "ionic|fast drying|low noise|foldable handle", "color", (25, 120)),
        ("makeup brush set", "makeup brush set", "Tools & Accessories › Makeup Brushes & Tools › Brush Sets",
         "synthetic bristles|soft|with case|dense", "color", (8, 35)),
        ("body wash", "body wash", "Bath & Body › Cleansers › Body Washes",
         "aloe vera|gentle|moisturizing|foaming", "scent floz", (6, 25)),
        ("perfume", "eau de parfum perfume", "Fragrance › Women's › Eau de Parfum",
         "floral|musk|elegant|gift box", "floz", (20, 150)),
        ("sunscreen", "sunscreen lotion", "Skin Care › Sun › Sunscreens & Tanning Products",
         "spf 50|water resistant|reef safe|broad spectrum", "floz", (8, 30)),
    ]),
    "fashion": ("Clothing, Shoes & Jewelry",
                "machine wash|hand wash|regular fit|slim fit|relaxed fit|polyester spandex|cotton|lightweight|"
                "breathable|soft material|daily wear|button closure|elastic waist|long sleeve|short sleeve", [
        "Casual Summer Outfit", "for Party Beach Vacation", "Gift for Men", "Everyday Wear", "Plus Size",
        "with Pockets", "for Women Girls", "Workout Gym"], [
        ("women's dresses", "dress", "Women › Clothing › Dresses",
         "a-line|maxi|floral print|v-neck", "color size", (15, 60)),
        ("men's dress shirts", "dress shirt", "Men › Clothing › Shirts › Dress Shirts",
         "classic fit|wrinkle free|button down|cotton spandex", "color size", (15, 60)),
        ("men's t-shirts", "t-shirt", "Men › Clothing › Shirts › T-Shirts",
         "crew neck|graphic|moisture wicking|tagless", "color size", (8, 30)),
        ("women's sneakers", "sneaker", "Women › Shoes › Fashion Sneakers",
         "rubber sole|non slip|memory foam|lace up", "color shoe", (30, 90)),
        ("men's sandals", "sandal", "Men › Shoes › Sandals",
         "arch support|open toe|adjustable strap|rubber sole", "color shoe", (20, 70)),
        ("women's leggings", "legging", "Women › Clothing › Active › Leggings",
         "high waist|tummy control|squat proof|four way stretch", "color size", (12, 40)),
        ("men's jeans", "jean", "Men › Clothing › Jeans",
         "straight leg|stretch|zipper fly|five pocket", "color waist", (25, 80)),
        ("women's hoodies & sweatshirts", "hoodie sweatshirt", "Women › Clothing › Fashion Hoodies & Sweatshirts",
         "drawstring|fleece lined|kangaroo pocket|oversized", "color size", (20, 55)),
        ("baseball caps", "baseball cap", "Men › Accessories › Hats & Caps › Baseball Caps",
         "adjustable|sun protection|cotton twill|curved brim", "color", (10, 30)),
        ("men's watches", "wrist watch", "Men › Watches › Wrist Watches",
         "stainless steel|water resistant|quartz movement|analog display", "color", (25, 300)),
    ]),
    "garden": ("Home & Kitchen",
               "easy assembly|easy clean|space saving|durable|modern design|living room|bedroom|eco friendly|"
               "heavy duty|high density|non slip|lightweight|wood finish|home decor", [
        "for Living Room Bedroom", "Home Office", "Farmhouse Decor", "Gift Idea", "for Apartment Dorm",
        "Kitchen Essentials"], [
        ("console tables", "console table", "Furniture › Living Room Furniture › Tables › Sofa & Console Tables",
         "solid wood|storage shelf|industrial|metal frame", "color", (60, 250)),
        ("throw pillow covers", "pillow cover", "Home Décor › Decorative Pillows & Covers › Throw Pillow Covers",
         "hand painted|double sided|hidden zipper|linen", "color pillow", (8, 30)),
        ("throw blankets", "throw blanket", "Bedding › Blankets & Throws › Throws",
         "fleece throw|super soft|all season|sherpa", "color bed", (18, 60)),
        ("sheet sets", "bed sheet set", "Bedding › Sheets & Pillowcases › Sheet & Pillowcase Sets",
         "deep pocket|microfiber|wrinkle resistant|cooling", "color bed", (20, 80)),
        ("curtains", "curtain panel", "Home Décor › Window Treatments › Curtains & Drapes › Panels",
         "blackout|thermal insulated|grommet top|noise reducing", "color panel", (15, 60)),
        ("storage baskets", "storage basket", "Storage & Organization › Baskets & Bins › Storage Baskets",
         "foldable|with handles|woven|collapsible", "color", (10, 40)),
        ("coffee mugs", "coffee mug", "Kitchen & Dining › Dining & Entertaining › Drinkware › Mugs",
         "dishwasher safe|microwave safe|ceramic|large capacity", "color ounce", (8, 30)),
        ("wall clocks", "wall clock", "Home Décor › Clocks › Wall Clocks",
         "silent|battery operated|large numbers|decorative", "color", (15, 60)),
        ("area rugs", "area rug", "Home Décor › Area Rugs, Runners & Pads › Area Rugs",
         "washable|shag|low pile|stain resistant", "color rug", (30, 200)),
        ("bath towels", "bath towel set", "Bath › Towels › Bath Towels",
         "quick dry|highly absorbent|plush|cotton", "color", (15, 50)),
    ]),
    "electronics": ("Electronics",
                    "fast charging|high speed|easy to use|portable|long battery life|usb c|plug and play|compact|"
                    "high definition|wireless|durable|led indicator|travel friendly|energy saving", [
        "for Home Office", "Compatible with iPhone Android", "Travel Accessories", "Gift for Gamers",
        "Upgraded Version", "2 Pack"], [
        ("usb cables", "usb charging cable", "Computers & Accessories › Cables & Interconnects › USB Cables",
         "braided|tangle free|data transfer|reinforced connector", "length color", (6, 20)),
        ("wireless earbuds", "wireless earbud", "Headphones › Earbud Headphones",
         "noise cancelling|bluetooth 5.0|charging case|sweatproof", "color", (20, 120)),
        ("phone cases", "phone case", "Cell Phones & Accessories › Cases, Holsters & Sleeves › Basic Cases",
         "shockproof|slim|wireless charging compatible|raised edges", "phone color", (8, 30)),
        ("portable chargers", "portable power bank charger", "Cell Phones & Accessories › Chargers › Power Banks",
         "high capacity|led display|dual output|pass through charging", "capacity color", (15, 60)),
        ("bluetooth speakers", "bluetooth speaker", "Portable Audio & Video › Speakers › Bluetooth Speakers",
         "waterproof|deep bass|stereo pairing|built in microphone", "color", (20, 150)),
        ("computer mice", "wireless mouse", "Computers & Accessories › Keyboards, Mice & Accessories › Mice",
         "ergonomic|silent click|usb receiver|adjustable dpi", "color", (10, 50)),
        ("keyboards", "computer keyboard", "Computers & Accessories › Keyboards, Mice & Accessories › Keyboards",
         "mechanical|backlit|full size|quiet keys", "color", (20, 120)),
        ("screen protectors", "screen protector", "Cell Phones & Accessories › Accessories › Screen Protectors",
         "tempered glass|bubble free|case friendly|anti scratch", "phone pack", (6, 20)),
        ("hdmi cables", "hdmi cable", "Television & Video › Accessories › Cables › HDMI Cables",
         "4k|gold plated|ethernet|nylon braided", "length", (6, 30)),
        ("security cameras", "security camera", "Camera & Photo › Video Surveillance › Dome Cameras",
         "night vision|motion detection|1080p|two way audio", "pack", (25, 150)),
    ]),
    "grocery": ("Grocery & Gourmet Food",
                "gluten free|non gmo|organic|low sugar|keto friendly|vegan|high protein|no artificial flavors|"
                "kosher|family size|individually wrapped|resealable bag|natural|healthy snack", [
        "Snack Pack", "Variety Pack", "Gift Basket", "for Office Party", "Bulk Size", "Breakfast Essentials"], [
        ("ground coffee", "ground coffee", "Beverages › Coffee, Tea & Cocoa › Coffee › Ground Coffee",
         "100% arabica|fair trade|low acid|smooth", "roast ounce", (8, 30)),
        ("green tea", "green tea bag", "Beverages › Coffee, Tea & Cocoa › Tea › Green",
         "antioxidant|loose leaf|caffeine free|herbal", "pack", (5, 25)),
        ("protein bars", "protein bar", "Snack Foods › Bars › Protein Bars",
         "whey protein|high fiber|low carb|meal replacement", "flavor pack", (12, 40)),
        ("potato chips", "potato chip", "Snack Foods › Chips & Crisps › Potato Chips",
         "kettle cooked|sea salt|crunchy|thick cut", "flavor ounce", (3, 25)),
        ("olive oil", "extra virgin olive oil", "Pantry Staples › Cooking & Baking › Oils & Vinegars › Oils",
         "cold pressed|first harvest|glass bottle|mediterranean", "floz", (10, 45)),
        ("gummy candy", "gummy candy", "Snack Foods › Candy & Chocolate › Gummy Candy",
         "fat free|fruit flavored|sour|chewy", "flavor pack", (4, 25)),
        ("pasta", "pasta noodle", "Pantry Staples › Dried Beans, Grains & Rice › Pasta & Noodles › Pasta",
         "whole wheat|durum wheat|bronze cut|quick cooking", "pack", (3, 20)),
        ("honey", "raw honey", "Pantry Staples › Jams, Jellies & Sweet Spreads › Honey",
         "unfiltered|pure|wildflower|squeeze bottle", "ounce", (8, 35)),
        ("mixed nuts", "mixed nut", "Snack Foods › Nuts & Seeds › Mixed Nuts",
         "roasted|unsalted|jumbo|protein snack", "flavor ounce", (8, 40)),
        ("seasoning", "spice seasoning blend", "Pantry Staples › Herbs, Spices & Seasonings › Mixed Spices",
         "salt free|no msg|all purpose|grill", "ounce", (4, 20)),
    ]),
}
FILLER_NOUNS = set(  # title words a POS tagger would tag NOUN/PROPN (head nouns and brands are added per product)
    "gift set women men care kit salon value pack outfit party beach vacation wear size pockets girls workout "
    "gym room bedroom home office farmhouse decor idea apartment dorm kitchen essentials iphone android travel "
    "accessories gamers version basket variety bulk breakfast".split())
OPTION_RATE = 0.65  # non-decoy products with options (real: ~40%); 1,000 products give ~6k goals (real: 6,910)
BRAND_SYLLABLES = "ka lo vi ra ze no mi ta su ve ro lu da xi po fe".split()


# ----------------------------------------------------------------------------- catalog generation
def make_product(rng, asins, category, root, pool, fillers, ptype, decoy_of=None):
    """One product dict in WebShop's schema (engine.load_products), plus its hidden `price` and title `nouns`."""
    query, head, tail, type_attrs, groups, (lo, hi) = ptype
    attrs_pool, cat_pool = type_attrs.split("|"), pool.split("|")
    if decoy_of is None:
        attrs = rng.sample(attrs_pool, rng.randint(1, 3)) + rng.sample(cat_pool, rng.randint(1, 2))
    else:  # near miss: the target's attributes with one swapped, priced higher, options differ
        attrs = list(decoy_of["Attributes"])
        attrs[rng.randrange(len(attrs))] = rng.choice([a for a in attrs_pool + cat_pool if a not in attrs])
    brand = "".join(rng.sample(BRAND_SYLLABLES, rng.randint(2, 3))).capitalize()
    first = query.split()[0]
    gender = first.capitalize() + " " if first.endswith("'s") else ""   # "Women's "
    shown = [a.title() for a in attrs[:rng.randint(1, 3)]]   # some attributes appear in the title
    title = f"{brand} {gender}{' '.join(shown)} {head.title()} {', '.join(rng.sample(fillers, rng.randint(1, 2)))}"
    words = [w.lower().replace("'s", "") for w in title.split()]
    nouns = [w for w in words if w in FILLER_NOUNS or w in head.split() or w == brand.lower()]
    # options: all of the type's groups (3+ values each) or none; see OPTION_RATE
    options, with_options = {}, rng.random() < OPTION_RATE
    for g in groups.split():
        name, values = OPTION_POOLS[g][0], OPTION_POOLS[g][1].split("|")
        if decoy_of is not None and name in decoy_of["options"]:  # the target's values minus one
            keep = decoy_of["options"][name]
            options[name] = sorted(rng.sample(keep, max(1, len(keep) - 1)), key=values.index)
        elif decoy_of is None and with_options:
            options[name] = sorted(rng.sample(values, rng.randint(3, len(values))), key=values.index)
    price = round(rng.uniform(lo, hi), 2) if decoy_of is None else round(decoy_of["price"] * rng.uniform(1.3, 1.8), 2)
    pricing = [price] if rng.random() < 0.87 else [price, round(price * rng.uniform(1.2, 1.8), 2)]
    hidden = pricing[0] if len(pricing) == 1 else rng.uniform(*pricing)  # engine.generate_product_prices
    mentioned = [a for a in attrs if rng.random() < 0.6] + ([rng.choice(cat_pool)] if rng.random() < 0.3 else [])
    bullets = [f"{a.upper()}: this {head} is made to be {a}, tested for everyday use." for a in mentioned]
    bullets += rng.sample([f"Package includes 1 {head} from {brand}.", "Satisfaction guaranteed, contact us anytime.",
                           f"Great {head} for home, travel and gifts.", "Carefully inspected before shipping.",
                           f"Designed in {rng.choice(['California', 'Berlin', 'Tokyo'])} with premium materials."],
                          rng.randint(2, 3))
    rng.shuffle(bullets)
    description = "" if rng.random() < 0.3 else (
        f"The {brand} {head} is {', '.join(attrs)}. {rng.choice(['Loved by customers.', 'A bestseller.', ''])}").strip()
    asin = "B0" + "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", k=8))
    while asin in asins:
        asin = "B0" + "".join(rng.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789", k=8))
    asins.add(asin)
    product = dict(asin=asin, name=title, Title=title, query=query, category=category,
                   product_category=f"{root} › {tail}", Description=description, BulletPoints=bullets,
                   Attributes=attrs, options=options, pricing=pricing, Price=price_tag(pricing), price=hidden,
                   Rating="N.A.", Reviews=[], nouns=nouns, instruction_text=None, instruction_attributes=None)
    if decoy_of is None and rng.random() < 0.42:  # items_ins_v2: 415/1000 products carry an instruction
        ins = rng.sample(attrs, min(len(attrs), rng.randint(2, 4)))
        cut = rng.randint(1, min(2, len(ins)))
        text = f"Find me {', '.join(ins[:cut])} {query}"
        if ins[cut:]:
            text += f" {rng.choice(['with', 'for'])} {', '.join(ins[cut:])}"
        product.update(instruction_text=text, instruction_attributes=ins)
    return product


def price_tag(pricing):
    return f"${pricing[0]}" if len(pricing) == 1 else f"${pricing[0]} to ${pricing[1]}"  # engine.load_products


def generate_catalog(num_products=1000, seed=0):
    """Products cycle through the 50 types (20 of each for 1,000); ~30% of instructable ones get a decoy next."""
    rng, asins, products = random.Random(seed), set(), []
    types = [(cat, root, pool, fillers, t) for cat, (root, pool, fillers, ts) in CATALOG.items() for t in ts]
    last = {}  # type index -> the last product of that type
    for i in range(num_products):
        k = i % len(types)
        cat, root, pool, fillers, ptype = types[k]
        prev = last.get(k)
        decoy = prev if prev and prev["instruction_text"] and rng.random() < 0.3 else None
        last[k] = make_product(rng, asins, cat, root, pool, fillers, ptype, decoy_of=decoy)
        products.append(last[k])
    return products


def build_goals(products, seed=0):
    """engine/goal.py get_synthetic_goals, then SimServer's random.seed(233); random.shuffle(goals)."""
    rng, goals = random.Random(f"goals-{seed}"), []
    for p in products:
        if not p.get("instruction_text") or not p.get("instruction_attributes"):
            continue
        cands = [b for b in PRICE_RANGE if b > p["price"]][:4]
        if len(cands) >= 2:  # larger of two of the next four $10 steps above the hidden price
            price_upper = max(rng.sample(cands, 2))
            price_text = f", and price lower than {price_upper:.2f} dollars"
        else:
            price_upper, price_text = 1000000.0, ""
        names = sorted(p["options"])
        for combo in itertools.product(*(p["options"][n] for n in names)):  # one goal per option combination
            goal_options = dict(zip(names, combo))
            option_text = ", and ".join(f"{k}: {v}" for k, v in goal_options.items())
            option_text = " with " + option_text if option_text else ""
            goals.append(dict(asin=p["asin"], category=p["category"], query=p["query"], name=p["Title"],
                              product_category=p["product_category"], nouns=p["nouns"],
                              instruction_text=f"{p['instruction_text']}{option_text}{price_text}",
                              attributes=p["instruction_attributes"], price_upper=price_upper,
                              goal_options=goal_options))
    random.Random(233).shuffle(goals)
    return goals


# ----------------------------------------------------------------------------- real WebShop data (optional)
MAX_JSON_BYTES = 300 * 2**20  # the 1k files are 4.5 MB; the full items_shuffle.json (5.5 GB) cannot be json.load-ed


_NLP = {}  # spaCy pipeline, loaded on first use if spaCy and en_core_web_sm happen to be installed


def title_nouns(title):
    """Nouns of a title for r_type: spaCy en_core_web_sm tags as WebShop does, else a heuristic."""
    if "nlp" not in _NLP:
        try:
            import spacy
            _NLP["nlp"] = spacy.load("en_core_web_sm")
        except Exception:
            _NLP["nlp"] = None
    if _NLP["nlp"] is not None:
        return [t.text.lower() for t in _NLP["nlp"](title) if t.pos_ in ("PNOUN", "NOUN", "PROPN")]
    # heuristic (approximate r_type): alphabetic words minus stop words and colour words
    return [w for w in re.findall(r"[a-z]+", title.lower()) if w not in STOPWORDS and w not in COLOR_SET and len(w) > 2]


def load_webshop_json(items_path, attrs_path, seed=0):
    """Read items_shuffle_1000.json + items_ins_v2_1000.json the way engine.load_products does."""
    for path in (items_path, attrs_path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"WebShop data file not found: {path}")
        if os.path.getsize(path) > MAX_JSON_BYTES:
            raise ValueError(f"{path} is {os.path.getsize(path) / 2**30:.1f} GiB; files over "
                             f"{MAX_JSON_BYTES // 2**20} MiB are refused (use the 1k 'small' files)")
    with open(items_path) as f:
        raw = json.load(f)
    with open(attrs_path) as f:
        ins = json.load(f)
    rng, products, seen = random.Random(seed), [], set()
    for item in raw:
        asin = item.get("asin", "nan")
        if asin == "nan" or len(asin) > 10 or asin in seen:  # load_products skips these rows
            continue
        seen.add(asin)
        pricing = [float(re.sub(r"[^\d.]", "", s) or 0) for s in (item.get("pricing") or "").split("$")[1:]][:2]
        pricing = pricing or [100.0]  # missing price -> $100.0
        options = {name.lower(): [v["value"].strip().replace("/", " | ").lower() for v in values]
                   for name, values in (item.get("customization_options") or {}).items() if values}
        meta, title = ins.get(asin, {}), item.get("name", "")
        bullets = item.get("small_description") or []
        products.append(dict(
            asin=asin, name=title, Title=title, query=(item.get("query") or "").lower().strip(),
            category=item.get("category", ""), product_category=item.get("product_category", ""),
            Description=item.get("full_description") or "", BulletPoints=bullets if isinstance(bullets, list)
            else [bullets], Attributes=meta.get("attributes") or ["DUMMY_ATTR"], options=options, pricing=pricing,
            Price=price_tag(pricing), price=pricing[0] if len(pricing) == 1 else rng.uniform(*pricing),
            Rating="N.A.", Reviews=[], nouns=title_nouns(title), instruction_text=meta.get("instruction"),
            instruction_attributes=meta.get("instruction_attributes")))
    return products


# ----------------------------------------------------------------------------- BM25 search
def stem(w):
    """A light plural stemmer (Lucene's English analyzer uses Porter; this covers what product text needs)."""
    if len(w) > 4 and w.endswith("ies"):
        return w[:-3] + "y"
    if len(w) > 4 and w.endswith(("ches", "shes", "xes", "sses")):
        return w[:-2]
    if len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        return w[:-1]
    return w


def analyze(text):
    """Lower case, drop possessive 's, split on non-alphanumerics, drop Lucene stop words, stem."""
    text = text.lower().replace("'s", "")
    return [stem(t) for t in re.findall(r"[a-z0-9]+", text) if t not in STOPWORDS]


def document_text(p):
    """webshop-minimal setup_search_engine.py: Title, Description, first bullet point and the options."""
    option_text = ", and ".join(f"{name}: {', '.join(values)}" for name, values in p["options"].items())
    first_bullet = p["BulletPoints"][0] if p["BulletPoints"] else ""
    return f"{p['Title']} {p['Description']} {first_bullet} {option_text}".lower()


class BM25Index:
    """Lucene BM25 (pyserini defaults k1=0.9, b=0.4): idf = ln(1 + (N - n + 0.5) / (n + 0.5))."""

    def __init__(self, docs, k1=0.9, b=0.4):
        self.postings = {}  # term -> [(doc, term frequency)]
        lengths = []
        for d, text in enumerate(docs):
            tokens = analyze(text)
            lengths.append(len(tokens))
            for term, tf in Counter(tokens).items():
                self.postings.setdefault(term, []).append((d, tf))
        n, avgdl = len(docs), sum(lengths) / max(len(docs), 1)
        self.idf = {t: math.log(1 + (n - len(ps) + 0.5) / (len(ps) + 0.5)) for t, ps in self.postings.items()}
        self.norm = [k1 * (1 - b + b * dl / avgdl) for dl in lengths]  # per-document length normaliser

    def search(self, query, k=SEARCH_RETURN_N):
        """Indices of the top-k documents with a positive score, by (-score, document order)."""
        scores = {}
        for term in analyze(query):  # a repeated query term counts twice, as a repeated Lucene clause
            idf = self.idf.get(term, 0.0)
            for d, tf in self.postings.get(term, ()):
                scores[d] = scores.get(d, 0.0) + idf * tf / (tf + self.norm[d])
        return sorted(scores, key=lambda d: (-scores[d], d))[:k]


_SHOPS = {}  # module-level cache: one catalog + goals + index per process and config (RAGEN's SimServer singleton)


def load_shop(num_products=1000, catalog_seed=0, items_path=None, attrs_path=None):
    key = (num_products, catalog_seed, items_path, attrs_path)
    if key not in _SHOPS:
        t0 = time.perf_counter()
        if items_path:
            products = load_webshop_json(items_path, attrs_path, seed=catalog_seed)[:num_products]
        else:
            products = generate_catalog(num_products, catalog_seed)
        goals = build_goals(products, catalog_seed)
        t1 = time.perf_counter()
        index = BM25Index([document_text(p) for p in products])
        t2 = time.perf_counter()
        n = len(goals)  # WebShop/RAGEN: test = first 500, val = next 1,000, train = rest; 10/20/70% if small
        if n < 3:
            raise ValueError(f"the catalog yields {n} goals; at least 3 are needed for train/val/test")
        n_test, n_val = (500, 1000) if n >= 3000 else (max(1, n // 10), max(1, n // 5))
        perm = list(range(n))
        random.Random(42).shuffle(perm)  # ragen/env/webshop/env.py _get_permuted_index
        _SHOPS[key] = dict(products=products, by_asin={p["asin"]: p for p in products}, goals=goals,
                           index=index, perm=perm, splits=dict(test=n_test, val=n_val, train=n - n_test - n_val),
                           catalog_s=t1 - t0, index_s=t2 - t1)
    return _SHOPS[key]


# ----------------------------------------------------------------------------- reward (engine/goal.py)
def _fuzz_tokens(s):
    """thefuzz full_process: str(), ASCII only, non-alphanumeric runs -> space, lower, strip; then a token set."""
    s = str(s).encode("ascii", "ignore").decode()
    return set(re.sub(r"[^0-9A-Za-z]+", " ", s).lower().split())


def _indel_ratio(a, b):
    """100 * 2 * LCS(a, b) / (len a + len b), the LCS by bit-parallel dynamic programming (Hyyroe 2004)."""
    if not a and not b:
        return 100.0
    masks, full = {}, (1 << len(a)) - 1
    for i, ch in enumerate(a):
        masks[ch] = masks.get(ch, 0) | (1 << i)
    v = full
    for ch in b:
        u = v & masks.get(ch, 0)
        v = ((v + u) | (v - u)) & full
    lcs = len(a) - bin(v).count("1")
    return 200.0 * lcs / (len(a) + len(b))


def token_set_ratio(s1, s2):
    """thefuzz.fuzz.token_set_ratio (0..100, int)."""
    a, b = _fuzz_tokens(s1), _fuzz_tokens(s2)
    if not a or not b:
        return 0
    sect, ab, ba = " ".join(sorted(a & b)), " ".join(sorted(a - b)), " ".join(sorted(b - a))
    if sect and (not ab or not ba):  # one token set contains the other
        return 100
    c1, c2 = f"{sect} {ab}".strip(), f"{sect} {ba}".strip()
    return round(max(_indel_ratio(sect, c1), _indel_ratio(sect, c2), _indel_ratio(c1, c2)))


def normalize_color(s):
    """engine/normalize.py: the first COLOR_SET word `in` s. For a tuple that means an element equal to it."""
    for color in COLOR_SET:
        if color in s:
            return color
    return s


def type_reward(goal, product):
    """goal.get_type_reward: same query, >= 2 shared breadcrumb levels, or title-noun overlap."""
    query_match = product["query"] == goal["query"]
    cats = [{x.strip() for x in c.split("›")} for c in (product["product_category"], goal["product_category"])]
    category_match = len(cats[0] & cats[1]) >= 2
    goal_nouns = goal["nouns"] if "nouns" in goal else title_nouns(goal["name"])
    product_nouns = product["nouns"] if "nouns" in product else title_nouns(product["name"])
    title_score = len(set(goal_nouns) & set(product_nouns)) / len(goal_nouns) if goal_nouns else 0.2
    r_type = 1.0  # the rules override each other in this order (goal.py lines 165-172)
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0:
        r_type = 0.0
    return r_type, query_match, category_match, title_score


def webshop_reward(goal, product, chosen_options):
    """goal.get_reward(verbose=True): r_type * (N_att + N_opt + [price ok]) / (|att| + |opt| + 1).

    `chosen_options`: dict option name -> clicked value (or a list of values). `product["price"]` is the
    hidden price. Returns (reward, info) with WebShop's breakdown (r_option/w_option only if the goal has options).
    """
    r_type, query_match, category_match, title_score = type_reward(goal, product)
    text_fields = (product["Title"].lower(), " ".join(product["BulletPoints"]).lower(), product["Description"].lower())
    n_att = 0
    for g in goal["attributes"]:  # fuzzy match against the attribute list, else a substring of the texts
        if any(token_set_ratio(p, g) > 85 for p in product["Attributes"]) or any(g in t for t in text_fields):
            n_att += 1
    chosen = chosen_options.values() if isinstance(chosen_options, dict) else chosen_options
    purchased = [normalize_color(o) for o in chosen]
    # quirk kept: synthetic goal options are (name, value) tuples, so only a bare colour value normalises
    # and the rest is matched as the text "name value" ("large" bought for "x-large" counts as a match)
    goal_opts = goal["goal_options"].items() if isinstance(goal["goal_options"], dict) else goal["goal_options"]
    goal_opts = [normalize_color(g) for g in goal_opts]
    n_opt = sum(any(token_set_ratio(p, g) > 85 for p in purchased) for g in goal_opts)
    r_price = product["price"] <= goal["price_upper"]
    denom = len(goal["attributes"]) + len(goal_opts) + 1
    reward = r_type * (n_att + n_opt + r_price) / denom
    info = dict(r_type=r_type, r_att=n_att / len(goal["attributes"]), w_att=len(goal["attributes"]) / denom,
                query_match=query_match, category_match=category_match, title_score=title_score,
                r_price=r_price, w_price=1 / denom)
    if goal_opts:
        info.update(r_option=n_opt / len(goal_opts), w_option=len(goal_opts) / denom)
    return reward, info


# ----------------------------------------------------------------------------- the environment
class WebShopEnv:
    """WebShop's text mode behind RAGEN's wrapper: reset(seed, split) picks a goal, step takes one action string."""

    def __init__(self, num_products=1000, catalog_seed=0, items_path=None, attrs_path=None, hints=True):
        self.shop = load_shop(num_products, catalog_seed, items_path, attrs_path)  # shared, built once
        self.hints = hints  # RAGEN's RENDER_INSTRUCTIONS after the observation
        self.goal, self.page = None, None

    def reset(self, seed, split="train"):
        """RAGEN: test = seed % 500, val = 500 + seed % 1000, train = 1500 + seed % rest; then a fixed permutation."""
        if split not in ("train", "val", "test"):
            raise ValueError(f"split must be 'train', 'val' or 'test', not {split!r}")
        s = self.shop["splits"]
        idx = {"test": seed % s["test"], "val": s["test"] + seed % s["val"],
               "train": s["test"] + s["val"] + seed % s["train"]}[split]
        self.goal = self.shop["goals"][self.shop["perm"][idx]]
        self.page, self.page_num, self.asin, self.sub, self.results = "search", 1, None, None, []
        self.options, self.done, self.reward_info, self.final_reward = {}, False, {}, 0.0
        self.obs = f"Instruction: {self.goal['instruction_text']}"  # RAGEN renders get_instruction_text() at reset
        return self.render()

    # -- pages ---------------------------------------------------------------
    def _item_options(self):
        """option value -> its group, in page order; a value in two groups keeps one key (WebShop's dict)."""
        groups = {}
        for name, values in self.shop["by_asin"][self.asin]["options"].items():
            for v in values:
                groups[v] = name
        return groups

    def _page_text(self):
        """WebShop's `text` observation: the visible text nodes of the rendered page joined with ' [SEP] '."""
        instr = self.goal["instruction_text"]
        if self.page == "search":
            return " [SEP] ".join(["WebShop", "Instruction:", instr, "Search"])
        if self.page == "done":  # done_page.html (approximate; the episode is over when it shows)
            return f"Thank you for shopping with us! [SEP] Your score (min 0.0, max 1.0) [SEP] {self.final_reward}"
        head = ["Instruction:", instr, "Back to Search"]
        if self.page == "results":
            head.append(f"Page {self.page_num} (Total results: {len(self.results)})")
            head += (["< Prev"] if self.page_num > 1 else []) + ["Next >"]
            for asin in self._page_asins():
                p = self.shop["by_asin"][asin]
                head += [asin, p["Title"], p["Price"]]
            return " [SEP] ".join(head)
        p = self.shop["by_asin"][self.asin]
        head.append("< Prev")
        if self.page == "item":
            for name, values in p["options"].items():
                head += [name] + values
            head += [p["Title"], f"Price: {p['Price']}", f"Rating: {p['Rating']}", "Description", "Features",
                     "Reviews", "Buy Now"]
        elif self.sub == "description":
            head += [p["Description"]] if p["Description"] else []
        elif self.sub == "features":
            head += p["BulletPoints"]
        return " [SEP] ".join(head)  # reviews: always empty in WebShop

    def _page_asins(self):
        start = (self.page_num - 1) * PAGE_SIZE
        return self.results[start:start + PAGE_SIZE]

    def _clickables(self):
        """WebShop get_available_actions order: buttons in page order, product links, then option values."""
        if self.page == "search":
            return ["search"]
        if self.page == "results":
            buttons = ["back to search"] + (["< prev"] if self.page_num > 1 else []) + ["next >"]
            return buttons + [a.lower() for a in self._page_asins()]
        if self.page == "item":
            return ITEM_BUTTONS + list(self._item_options())
        return ["back to search", "< prev"] if self.page == "sub" else []

    def actions(self):
        """RAGEN get_available_actions: search[<content>] on the search page, click[x] for every clickable."""
        acts = (["search[<content>]"] if self.page == "search" else []) + \
            [f"click[{c}]" for c in self._clickables() if c != "search"]
        if acts == ["click[back to search]", "click[< prev]", "click[next >]"]:  # empty page past the end
            acts.remove("click[next >]")
        return acts

    def render(self):
        """RAGEN prepare_render_cache: observation + '.' + hints + the available actions."""
        hints = "\n".join(RENDER_INSTRUCTIONS) if self.hints else ""
        return f"{self.obs}.{hints}\n You must choose from these actions:{', '.join(self.actions())}."

    # -- one action ----------------------------------------------------------
    def step(self, action):
        """One action string -> (render, reward, done, info). Anything unavailable is an invalid no-op."""
        info = dict(action_is_valid=False, action_is_effective=False, success=False)
        if self.goal is None:
            raise RuntimeError("call reset(seed) before step()")
        if self.done:  # after buy now: an invalid no-op
            return self.render(), 0.0, True, info
        m = re.match(r"(.+)\[(.+)\]", str(action).strip(), re.DOTALL)  # engine.parse_action, arg lower-cased
        verb, arg = (m.group(1).strip().lower(), m.group(2).strip().lower()) if m else ("", "")
        before, reward = self._page_text(), 0.0
        if verb == "search" and self.page == "search" and arg:
            self.results = [self.shop["products"][d]["asin"] for d in self.shop["index"].search(arg)]
            self.page, self.page_num, self.asin, self.options = "results", 1, None, {}
        elif verb == "click" and f"click[{arg}]" in self.actions():
            reward = self._click(arg)
        else:  # unknown or unavailable action: state unchanged (RAGEN drops it / WebShop ignores it)
            return self.render(), 0.0, False, info
        self.obs = self._page_text()
        success = reward >= 1.0 - 1e-9  # RAGEN: success = success_find = reward == 1
        info.update(action_is_valid=True, action_is_effective=self.obs != before,  # RAGEN: observation changed
                    success=success, success_find=int(success), success_purchase=int(self.done), reward=reward,
                    end_of_page=int(self.actions() == ["click[back to search]", "click[< prev]"]))
        if self.done:  # WebShop's reward breakdown, as numbers so the agent loop can average them
            info.update({k: float(v) for k, v in self.reward_info.items()})
        return self.render(), reward, self.done, info

    def _click(self, arg):
        """SimServer.receive: page transitions. Returns the reward (non-zero only for buy now)."""
        if arg == "back to search":  # resets the results, product and options; the goal stays
            self.page, self.page_num, self.asin, self.options = "search", 1, None, {}
        elif self.page == "results":
            if arg == "next >":
                self.page_num += 1
            elif arg == "< prev":
                self.page_num -= 1
            else:  # a product link (lower case in actions, upper case on the page)
                self.page, self.options = "item", {}
                self.asin = next(a for a in self._page_asins() if a.lower() == arg)
        elif self.page == "item":
            if arg == "< prev":  # back to the same results page; options are reset there
                self.page, self.asin, self.options = "results", None, {}
            elif arg in SUB_PAGES:
                self.page, self.sub = "sub", arg
            elif arg == "buy now":
                reward, self.reward_info = webshop_reward(self.goal, self.shop["by_asin"][self.asin], self.options)
                self.page, self.done, self.final_reward = "done", True, reward
                return reward
            else:  # an option value: the text observation does not change (only text_rich shows it)
                self.options[self._item_options()[arg]] = arg
        elif self.page == "sub" and arg == "< prev":
            self.page = "item"
        return 0.0


# ----------------------------------------------------------------------------- scripted policies and CLI
def search_words(goal):
    """The goal's own search words: its instruction without 'Find me', the options and the price clause."""
    text = goal["instruction_text"]
    if goal["price_upper"] < 1000000:
        text = text.removesuffix(f", and price lower than {goal['price_upper']:.2f} dollars")
    if isinstance(goal["goal_options"], dict) and goal["goal_options"]:
        text = text.removesuffix(" with " + ", and ".join(f"{k}: {v}" for k, v in goal["goal_options"].items()))
    return text.removeprefix("Find me ")


def run_oracle(env, seed, split="test"):
    """Search the goal's words (then, if needed, the target's title), page to the target, click its options, buy."""
    env.reset(seed, split)
    goal, n_actions = env.goal, 0
    target = f"click[{goal['asin'].lower()}]"
    for query in (search_words(goal), goal["name"]):
        env.step(f"search[{query}]")
        n_actions += 1
        while target not in env.actions() and "click[next >]" in env.actions():
            env.step("click[next >]")
            n_actions += 1
        if target in env.actions():
            break
        env.step("click[back to search]")
        n_actions += 1
    env.step(target)
    options = goal["goal_options"].values() if isinstance(goal["goal_options"], dict) else goal["goal_options"]
    for value in options:
        env.step(f"click[{value}]")
    _, reward, done, info = env.step("click[buy now]")
    return reward, info, n_actions + 2 + len(options)


def oracle_action(env):
    """run_oracle's next action from the current page alone (for a policy that acts one turn at a time): search the
    goal's words, page to the target, open it, click its options, buy; anything else leads back toward that."""
    goal, acts = env.goal, env.actions()
    target = f"click[{goal['asin'].lower()}]"
    if env.page == "search":
        return f"search[{search_words(goal)}]"
    if env.page == "results":
        return target if target in acts else "click[next >]" if "click[next >]" in acts else "click[back to search]"
    if env.page == "item" and env.asin.lower() == goal["asin"].lower():
        options = goal["goal_options"].values() if isinstance(goal["goal_options"], dict) else goal["goal_options"]
        todo = [v.lower() for v in options if f"click[{v.lower()}]" in acts and v.lower() not in env.options.values()]
        return f"click[{todo[0]}]" if todo else "click[buy now]"
    return "click[< prev]"  # another product, or a sub-page


def run_random(env, seed, split="test", budget=9):
    """A random clicker: a uniformly random available action, searching 3 random words of the goal."""
    rng = random.Random(seed)
    env.reset(seed, split)
    reward, info = 0.0, {"success": False}
    for _ in range(budget):
        action = rng.choice(env.actions())
        if action == "search[<content>]":
            words = search_words(env.goal).split()
            action = f"search[{' '.join(rng.sample(words, min(3, len(words))))}]"
        _, reward, done, info = env.step(action)
        if done:
            break
    return reward, info


def solver_actions(env, k):
    """sft.py's solver: the oracle's next action (one per turn: the page changes after every action)."""
    return [oracle_action(env)]


def random_actions(env, k, rng):
    """One uniformly drawn click, or a search of 3 of the goal's words (as run_random; one action per turn)."""
    action = rng.choice(env.actions())
    if action == "search[<content>]":
        words = search_words(env.goal).split()
        action = f"search[{' '.join(rng.sample(words, min(3, len(words))))}]"
    return [action]


def add_flags(p):
    """env_webshop.py's own flags (play.py): the catalog (to the constructor), the goal split (to reset), and its
    statistics besides --random N: --oracle N and --stats."""
    p.add_argument("--num-products", type=int, default=None, help="catalog size (synthetic) or cap (real data) "
                   "(default: the preset's)")
    p.add_argument("--catalog-seed", type=int, default=None, help="seed of the synthetic catalog and prices "
                   "(default: the preset's)")
    p.add_argument("--items", dest="items_path", default=None, help="real WebShop items_shuffle_1000.json (optional)")
    p.add_argument("--attrs", dest="attrs_path", default=None, help="real WebShop items_ins_v2_1000.json (with --items)")
    p.add_argument("--split", default="test", choices=["train", "val", "test"], help="goal split")
    p.add_argument("--oracle", type=int, default=0, metavar="N", help="run the scripted oracle on N goals")
    p.add_argument("--stats", action="store_true", help="build times, split sizes, BM25 top-10 rate, timings")


def print_statistics(env, args):
    """python env_webshop.py --stats / --oracle N / --random N (play.py): the catalog's numbers and timings, the
    scripted oracle and the random clicker (9 actions) on N goals of --split from --seed. False without any."""
    if not (args.stats or args.oracle or args.random):
        return False
    shop = env.shop
    seeds = range(args.seed, args.seed + max(args.oracle, args.random))
    if args.stats:
        goals = shop["goals"]
        print(f"{len(shop['products'])} products, {len(goals)} goals; splits {shop['splits']}; catalog+goals "
              f"{shop['catalog_s']:.3f} s, BM25 index {shop['index_s']:.3f} s")
        t0 = time.perf_counter()
        hits = [g["asin"] in {shop["products"][d]["asin"] for d in shop["index"].search(search_words(g), PAGE_SIZE)}
                for g in goals]
        print(f"BM25 top-10 rate for the goal's search words: {sum(hits) / len(hits):.3f} over all "
              f"{len(goals)} goals ({1e3 * (time.perf_counter() - t0) / len(goals):.2f} ms/query)")
        reset_s, step_s = [], []
        for seed in range(200):
            t0 = time.perf_counter()
            env.reset(seed, "train")
            reset_s.append(time.perf_counter() - t0)
            rng = random.Random(seed)
            for _ in range(9):
                action = rng.choice(env.actions()).replace("<content>", env.goal["query"])
                t0 = time.perf_counter()
                _, _, done, _ = env.step(action)
                step_s.append(time.perf_counter() - t0)
                if done:
                    break
        print(f"median reset {1e3 * statistics.median(reset_s):.3f} ms, median step "
              f"{1e3 * statistics.median(step_s):.3f} ms ({len(step_s)} random steps)")
    if args.oracle:
        runs = [run_oracle(env, s, args.split) for s in seeds[:args.oracle]]
        print(f"oracle on {args.oracle} {args.split} goals: mean reward {statistics.mean(r for r, _, _ in runs):.4f}, "
              f"success {statistics.mean(i['success'] for _, i, _ in runs):.4f}, mean actions "
              f"{statistics.mean(n for _, _, n in runs):.2f}")
    if args.random:
        runs = [run_random(env, s, args.split) for s in seeds[:args.random]]
        print(f"random clicker (9 actions) on {args.random} {args.split} goals: mean reward "
              f"{statistics.mean(r for r, _ in runs):.4f}, "
              f"success {statistics.mean(i['success'] for _, i in runs):.4f}")
    return True


if __name__ == "__main__":  # play a shop in the terminal, or --stats / --oracle N / --random N (play.py)
    import play
    play.main(WebShopEnv)
